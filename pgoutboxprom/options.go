package pgoutboxprom

import (
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// DefaultNamespace is the metrics' namespace when Options.Namespace is empty.
const DefaultNamespace = "pgoutbox"

// DefaultScrapeTimeout bounds a Collector's Stats call when
// Options.ScrapeTimeout is zero.
const DefaultScrapeTimeout = 5 * time.Second

// Options tune NewCollector and NewObserver. The zero value is usable.
type Options struct {
	// Namespace and Subsystem prefix every metric name, as in Watermill's
	// PrometheusMetricsBuilder: Namespace_Subsystem_name. Namespace
	// defaults to "pgoutbox"; Subsystem to none.
	Namespace string
	Subsystem string
	// ConstLabels are added to every metric (e.g. {"outbox": "orders"}
	// when one process watches several outboxes on one registry).
	ConstLabels prometheus.Labels

	// ScrapeTimeout bounds the Collector's Stats call on each scrape.
	// Defaults to 5s; at least pgoutbox.MinDuration (a shorter one makes
	// every scrape report the configuration error). A call that fails or
	// times out increments stats_errors_total and exposes no outbox
	// gauges for that scrape.
	ScrapeTimeout time.Duration
	// StatsOptions narrow what the Collector reports, e.g.
	// pgoutbox.StatsForTopic("orders").
	StatsOptions []pgoutbox.StatsOption
	// Logger receives the Collector's failed Stats calls. Defaults to none.
	Logger watermill.LoggerAdapter
}

func (o Options) name(name string) string {
	ns := o.Namespace
	if ns == "" {
		ns = DefaultNamespace
	}
	return prometheus.BuildFQName(ns, o.Subsystem, name)
}
