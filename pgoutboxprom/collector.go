package pgoutboxprom

import (
	"context"
	"fmt"
	"strconv"
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

// Snapshot holder kinds of the oldest-snapshot gauges: the values of
// pgoutbox.SnapshotKind.
const (
	KindBackend         = string(pgoutbox.SnapshotBackend)
	KindReplicationSlot = string(pgoutbox.SnapshotReplicationSlot)
	KindPreparedXact    = string(pgoutbox.SnapshotPreparedXact)
)

// Collector is a prometheus.Collector that reads pgoutbox.Stats and
// pgoutbox.Health on each scrape. Stats is cheap but not free (about 300 ms
// on an outbox of 1,000,000 rows, see the README): scrape every 15 to 60
// seconds; Health reads catalogs only (milliseconds). Concurrent scrapes
// run one pair of calls at a time.
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
	paused      *prometheus.Desc
	liveTuples  *prometheus.Desc
	deadTuples  *prometheus.Desc
	tableBytes  *prometheus.Desc
	indexBytes  *prometheus.Desc
	snapshotAge *prometheus.Desc
	snapshotXid *prometheus.Desc
	ringAge     *prometheus.Desc
	ringRows    *prometheus.Desc
	errors      prometheus.Counter
	duration    prometheus.Gauge

	mu sync.Mutex // one Stats call at a time

	// invalid is what is wrong with NewCollector's arguments: every
	// scrape fails with it, where it would otherwise export no series.
	invalid error
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a Collector of the outbox named by tables, read
// through exec (a pool: tx.FromPgxPool or tx.FromSQLDB). Register it with
// prometheus.Registerer.Register or MustRegister. A nil exec or invalid
// table names make every scrape fail with an error that says so
// (prometheus.NewInvalidMetric: promhttp answers 500 with its text).
func NewCollector(exec tx.Executor, tables schema.Config, opts Options) *Collector {
	var invalid error
	if exec == nil {
		invalid = fmt.Errorf("%w: pgoutboxprom: executor is nil; pass tx.FromPgxPool(pool) or another tx executor", pgoutbox.ErrInvalidConfig)
	} else if err := tables.Validate(); err != nil {
		invalid = fmt.Errorf("%w: pgoutboxprom: %w", pgoutbox.ErrInvalidConfig, err)
	}
	if invalid == nil && opts.ScrapeTimeout > 0 && opts.ScrapeTimeout < pgoutbox.MinDuration {
		invalid = fmt.Errorf("%w: pgoutboxprom: ScrapeTimeout is %s; it must be at least %s (a bare number is nanoseconds: write %d * time.Second)",
			pgoutbox.ErrInvalidConfig, opts.ScrapeTimeout, pgoutbox.MinDuration, int64(opts.ScrapeTimeout))
	}
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
		invalid: invalid,
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
		paused: prometheus.NewDesc(opts.name("consumer_group_paused"),
			"1 while the consumer group is paused on the topic (PauseGroup, pgoutbox pause), else 0: its lag grows by design, "+
				"so an alert on oldest_ready_age_seconds can leave it out.",
			pair, opts.ConstLabels),
		liveTuples: prometheus.NewDesc(opts.name("table_live_tuples"),
			"Estimated live rows of the outbox table and of its dead-letter table (pg_stat_user_tables.n_live_tup).",
			[]string{"table"}, opts.ConstLabels),
		deadTuples: prometheus.NewDesc(opts.name("table_dead_tuples"),
			"Estimated dead rows vacuum has not removed yet (pg_stat_user_tables.n_dead_tup). A queue makes them all the time and "+
				"autovacuum removes them; alert when they keep growing for longer than a few autovacuum runs, and look at "+
				"oldest_snapshot_age_seconds for what holds them.",
			[]string{"table"}, opts.ConstLabels),
		tableBytes: prometheus.NewDesc(opts.name("table_bytes"),
			"Size of the table with its TOAST data (pg_table_size). A queue's should stay flat; steady growth means vacuum "+
				"cannot keep up or is held back.",
			[]string{"table"}, opts.ConstLabels),
		indexBytes: prometheus.NewDesc(opts.name("table_index_bytes"),
			"Size of the table's indexes (pg_indexes_size); growth makes every claim slower.",
			[]string{"table"}, opts.ConstLabels),
		snapshotAge: prometheus.NewDesc(opts.name("oldest_snapshot_age_seconds"),
			"How long the oldest transaction of each kind (backend: a session of the outbox's database or a replica's "+
				"feedback; prepared_xact) has held the snapshot that keeps vacuum from removing the outbox's dead rows; "+
				"0 when none. Alert above 10 minutes (pgoutbox health names the holder). Replication slots record no time: "+
				"see oldest_snapshot_xmin_age. Without pg_read_all_stats (pg_monitor) other roles' sessions show no time: "+
				"when no holder's time is known (such sessions, a replica's feedback), the kind has no sample rather than "+
				"a 0; with some known, the oldest known (a lower bound). oldest_snapshot_xmin_age shows them all.",
			[]string{"kind"}, opts.ConstLabels),
		snapshotXid: prometheus.NewDesc(opts.name("oldest_snapshot_xmin_age"),
			"Transactions begun since the oldest snapshot of each kind (backend, replication_slot, prepared_xact) that keeps "+
				"vacuum from removing the outbox's dead rows (age of its xmin); 0 when none. Alert when it grows for minutes "+
				"without falling back, and long before autovacuum_freeze_max_age (200 million by default). Logical slots' "+
				"catalog_xmin is left out: it holds the catalogs, not the outbox.",
			[]string{"kind"}, opts.ConstLabels),
		ringAge: prometheus.NewDesc(opts.name("ring_current_age_seconds"),
			"A rotating outbox only: how long the ring's current partition has taken the new rows. The ring advances every "+
				"RotationWindow (3s by default) once the next partition is empty; alert above a minute: the next partition "+
				"cannot be emptied (pgoutbox health says what holds it), or no subscriber runs.",
			[]string{"table"}, opts.ConstLabels),
		ringRows: prometheus.NewDesc(opts.name("ring_partition_rows"),
			"A rotating outbox only: each ring partition's estimated live rows (n_live_tup), by generation.",
			[]string{"table", "generation"}, opts.ConstLabels),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        opts.name("stats_errors_total"),
			Help:        "Scrapes whose pgoutbox.Stats or pgoutbox.Health call failed or timed out (they expose none of the failed call's gauges).",
			ConstLabels: opts.ConstLabels,
		}),
		duration: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        opts.name("stats_duration_seconds"),
			Help:        "How long the last pgoutbox.Stats and pgoutbox.Health calls took.",
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
	ch <- c.paused
	ch <- c.liveTuples
	ch <- c.deadTuples
	ch <- c.tableBytes
	ch <- c.indexBytes
	ch <- c.snapshotAge
	ch <- c.snapshotXid
	ch <- c.ringAge
	ch <- c.ringRows
	c.errors.Describe(ch)
	c.duration.Describe(ch)
}

// Collect implements prometheus.Collector: one pgoutbox.Stats and one
// pgoutbox.Health call, bounded together by Options.ScrapeTimeout.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	if c.invalid != nil {
		ch <- prometheus.NewInvalidMetric(c.messages, c.invalid)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	start := time.Now()
	// Health first: behind an exclusive lock on the outbox it answers
	// (TableHealth.Locked) where Stats waits out the timeout.
	health, healthErr := pgoutbox.Health(ctx, c.exec, c.tables)
	stats, err := pgoutbox.Stats(ctx, c.exec, c.tables, c.opts...)
	c.duration.Set(time.Since(start).Seconds())
	if err != nil || healthErr != nil {
		c.errors.Inc()
	}
	if healthErr != nil {
		c.logger.Error("pgoutbox health for Prometheus failed", healthErr, nil)
	} else {
		c.collectHealth(ch, health)
	}
	if err != nil {
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
			paused := 0.0
			if s.Paused {
				paused = 1
			}
			ch <- prometheus.MustNewConstMetric(c.paused, prometheus.GaugeValue, paused, s.Topic, s.ConsumerGroup)
			for reason, n := range s.DeadLetters {
				ch <- prometheus.MustNewConstMetric(c.deadLetters, prometheus.GaugeValue, float64(n), s.Topic, s.ConsumerGroup, reason)
			}
		}
	}
	c.errors.Collect(ch)
	c.duration.Collect(ch)
}

// collectHealth sends the tables' gauges and, per kind of snapshot holder,
// the oldest one's age (0 for a kind with none, so an alert resolves
// rather than going stale).
func (c *Collector) collectHealth(ch chan<- prometheus.Metric, h pgoutbox.HealthReport) {
	for _, t := range []*pgoutbox.TableHealth{&h.Outbox, h.DeadLetters, h.Arrivals} {
		if t == nil {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.liveTuples, prometheus.GaugeValue, float64(t.LiveTuples), t.Table)
		ch <- prometheus.MustNewConstMetric(c.deadTuples, prometheus.GaugeValue, float64(t.DeadTuples), t.Table)
		if t.Locked {
			continue // its sizes were not read: no sample, not a drop to 0
		}
		ch <- prometheus.MustNewConstMetric(c.tableBytes, prometheus.GaugeValue, float64(t.TableBytes), t.Table)
		ch <- prometheus.MustNewConstMetric(c.indexBytes, prometheus.GaugeValue, float64(t.IndexBytes), t.Table)
	}
	if r := h.Ring; r != nil {
		if r.Current >= 0 {
			ch <- prometheus.MustNewConstMetric(c.ringAge, prometheus.GaugeValue, r.CurrentFor.Seconds(), h.Outbox.Table)
		}
		for g, n := range r.Rows {
			ch <- prometheus.MustNewConstMetric(c.ringRows, prometheus.GaugeValue, float64(n), h.Outbox.Table, strconv.Itoa(g))
		}
	}
	age := map[string]time.Duration{KindBackend: 0, KindPreparedXact: 0}
	xmin := map[string]int64{KindBackend: 0, KindReplicationSlot: 0, KindPreparedXact: 0}
	// Whether a kind has holders with a time, and holders whose time is
	// unknown (another role's session seen without pg_read_all_stats; a
	// replica's feedback).
	timed, untimed := map[string]bool{}, map[string]bool{}
	for _, s := range h.SnapshotHolders {
		if s.CatalogOnly {
			continue
		}
		k := string(s.Kind)
		if _, ok := age[k]; ok {
			if s.Since.IsZero() {
				untimed[k] = true
			} else {
				age[k] = max(age[k], s.Age)
				timed[k] = true
			}
		}
		if _, ok := xmin[k]; ok {
			xmin[k] = max(xmin[k], s.XminAge)
		}
	}
	for k, d := range age {
		if untimed[k] && !timed[k] {
			// Held back, for a time nobody here can know: no sample
			// rather than 0, which reads as "none". With a timed holder
			// too, its age is a lower bound, and still trips an alert.
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.snapshotAge, prometheus.GaugeValue, d.Seconds(), k)
	}
	for k, n := range xmin {
		ch <- prometheus.MustNewConstMetric(c.snapshotXid, prometheus.GaugeValue, float64(n), k)
	}
}
