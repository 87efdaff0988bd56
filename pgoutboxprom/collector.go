package pgoutboxprom

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Message states of the messages gauge.
const (
	StateReady        = "ready"
	StateScheduled    = "scheduled"
	StateLeased       = "leased"
	StateExpiredLease = "expired_lease"
	StateParked       = "parked"
)

// Collector is a prometheus.Collector that reads pgoutbox.Stats on each
// scrape. Stats is cheap but not free (about 300 ms on an outbox of
// 1,000,000 rows, see the README): scrape every 15 to 60 seconds.
// Concurrent scrapes run one Stats call at a time.
type Collector struct {
	exec    tx.Executor
	tables  schema.Config
	timeout time.Duration
	opts    []pgoutbox.StatsOption
	logger  watermill.LoggerAdapter

	messages    *prometheus.Desc
	oldestAge   *prometheus.Desc
	deadLetters *prometheus.Desc
	unbound     *prometheus.Desc
	errors      prometheus.Counter
	duration    prometheus.Gauge

	mu sync.Mutex // one Stats call at a time
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a Collector of the outbox named by tables, read
// through exec (a pool: tx.FromPgxPool or tx.FromSQLDB). Register it with
// prometheus.Registerer.Register or MustRegister.
func NewCollector(exec tx.Executor, tables schema.Config, opts Options) *Collector {
	timeout := opts.ScrapeTimeout
	if timeout <= 0 {
		timeout = DefaultScrapeTimeout
	}
	logger := opts.Logger
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	pair := []string{"topic", "consumer_group"}
	return &Collector{
		exec:    exec,
		tables:  tables,
		timeout: timeout,
		opts:    opts.StatsOptions,
		logger:  logger,
		messages: prometheus.NewDesc(opts.name("messages"),
			"Rows of the outbox per topic, consumer group and state (ready, scheduled, leased, expired_lease, parked).",
			append(pair, "state"), opts.ConstLabels),
		oldestAge: prometheus.NewDesc(opts.name("oldest_ready_age_seconds"),
			"How long the oldest ready row of the consumer group has been due (its lag); 0 when nothing is ready.",
			pair, opts.ConstLabels),
		deadLetters: prometheus.NewDesc(opts.name("dead_letters"),
			"Rows of the dead-letter table per topic, consumer group and failure reason.",
			append(pair, "reason"), opts.ConstLabels),
		unbound: prometheus.NewDesc(opts.name("unbound_messages"),
			"Rows of a consumer group that is not bound to the topic: messages no bound group will consume (alert on > 0; "+
				"for the default group, messages published while nothing was bound, which the next group to bind gets).",
			pair, opts.ConstLabels),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        opts.name("stats_errors_total"),
			Help:        "Scrapes whose pgoutbox.Stats call failed or timed out (they expose no outbox gauges).",
			ConstLabels: opts.ConstLabels,
		}),
		duration: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        opts.name("stats_duration_seconds"),
			Help:        "How long the last pgoutbox.Stats call took.",
			ConstLabels: opts.ConstLabels,
		}),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.messages
	ch <- c.oldestAge
	ch <- c.deadLetters
	ch <- c.unbound
	c.errors.Describe(ch)
	c.duration.Describe(ch)
}

// Collect implements prometheus.Collector: one pgoutbox.Stats call, bounded
// by Options.ScrapeTimeout.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	start := time.Now()
	stats, err := pgoutbox.Stats(ctx, c.exec, c.tables, c.opts...)
	c.duration.Set(time.Since(start).Seconds())
	if err != nil {
		c.errors.Inc()
		c.logger.Error("pgoutbox stats for Prometheus failed", err, nil)
	} else {
		for _, s := range stats {
			for _, v := range [...]struct {
				state string
				n     int64
			}{
				{StateReady, s.Ready},
				{StateScheduled, s.Scheduled},
				{StateLeased, s.Leased},
				{StateExpiredLease, s.ExpiredLeases},
				{StateParked, s.Parked},
			} {
				ch <- prometheus.MustNewConstMetric(c.messages, prometheus.GaugeValue, float64(v.n), s.Topic, s.ConsumerGroup, v.state)
			}
			ch <- prometheus.MustNewConstMetric(c.oldestAge, prometheus.GaugeValue, s.OldestReadyAge.Seconds(), s.Topic, s.ConsumerGroup)
			ch <- prometheus.MustNewConstMetric(c.unbound, prometheus.GaugeValue, float64(s.Unbound()), s.Topic, s.ConsumerGroup)
			for reason, n := range s.DeadLetters {
				ch <- prometheus.MustNewConstMetric(c.deadLetters, prometheus.GaugeValue, float64(n), s.Topic, s.ConsumerGroup, reason)
			}
		}
	}
	c.errors.Collect(ch)
	c.duration.Collect(ch)
}
