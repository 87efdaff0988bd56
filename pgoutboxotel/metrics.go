package pgoutboxotel

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Attributes of the metrics besides messaging.destination.name (the
// topic) and messaging.consumer.group.name ("" for the default group).
const (
	// StateKey is the state of the rows of the messages gauge: "ready",
	// "scheduled", "leased", "expired_lease" or "parked".
	StateKey = attribute.Key("pgoutbox.state")
	// ReasonKey is a dead letter's failure reason (pgoutbox.Reason...).
	ReasonKey = attribute.Key("pgoutbox.failure_reason")
	// PhaseKey is the write that found its lease lost: "ack", "nack",
	// "release", "renew" or "dead_letter"; "commit" for a held batch
	// whose transaction did not commit (a lost connection);
	// "ack_unanswered" for an ack written again after its reply was lost
	// that found the row gone (most likely deleted by the first).
	PhaseKey = attribute.Key("pgoutbox.phase")
	// TableKey is the schema-qualified table of the table gauges
	// ("public.outbox", its dead-letter and arrivals tables).
	TableKey = attribute.Key("pgoutbox.table")
	// SnapshotKindKey is the kind of snapshot holder of the oldest-snapshot
	// gauges: "backend", "replication_slot" or "prepared_xact"
	// (pgoutbox.SnapshotKind).
	SnapshotKindKey = attribute.Key("pgoutbox.snapshot_kind")
	// GenerationKey is a rotating outbox's ring partition (0, 1 or 2) of
	// the pgoutbox.ring.partition.rows gauge.
	GenerationKey = attribute.Key("pgoutbox.generation")
)

// DefaultStatsTimeout bounds the Stats call of a collection when
// MetricsOptions.StatsTimeout is zero.
const DefaultStatsTimeout = 5 * time.Second

// DefaultLatenessBuckets are the lateness histogram's bucket boundaries,
// in seconds, when MetricsOptions.LatenessBuckets is nil: from 5 ms (a
// subscriber woken by NOTIFY) to an hour (a backlog).
var DefaultLatenessBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}

// MetricsOptions configure NewObserver and RegisterStats. The zero value
// is usable.
type MetricsOptions struct {
	// MeterProvider makes the instruments. Defaults to the global one
	// (otel.GetMeterProvider).
	MeterProvider metric.MeterProvider
	// Attributes are added to every measurement (e.g. attribute.String(
	// "outbox", "orders") when one process watches several outboxes).
	Attributes []attribute.KeyValue
	// LatenessBuckets are the lateness histogram's bucket boundaries, in
	// seconds. Defaults to DefaultLatenessBuckets.
	LatenessBuckets []float64

	// StatsTimeout bounds RegisterStats' Stats call per collection.
	// Defaults to 5s; at least pgoutbox.MinDuration. A call that fails or
	// times out adds one to
	// pgoutbox.stats.errors and reports no outbox gauges that time.
	StatsTimeout time.Duration
	// StatsOptions narrow what RegisterStats reports, e.g.
	// pgoutbox.StatsForTopic("orders").
	StatsOptions []pgoutbox.StatsOption
	// Logger receives RegisterStats' failed Stats calls. Defaults to none.
	Logger watermill.LoggerAdapter
}

func (o MetricsOptions) meter() metric.Meter {
	mp := o.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(ScopeName)
}

// Observer is a pgoutbox.Observer that counts events with OpenTelemetry
// counters (the counters of pgoutboxprom's Observer) and records, for every
// message a subscriber hands to the Router, how late that was in the
// pgoutbox.subscriber.lateness histogram. Observe only adds to
// instruments: it never blocks on I/O. One Observer serves every publisher
// and subscriber of a process; set it as PublisherConfig.Observer and
// SubscriberConfig.Observer.
type Observer struct {
	attrs []attribute.KeyValue

	published, claims, claimed, heldClaimed, heldToLease, acked, retried, released,
	deadLettered, poisoned, renewed, leaseLost metric.Int64Counter
	lateness metric.Float64Histogram

	mu   sync.Mutex
	sets map[setKey]metric.MeasurementOption // attribute sets by topic, group and extra, built once
}

// setKey names an attribute set: a publisher's (topic only), or a
// subscriber's (topic, group and, when key is set, key=value).
type setKey struct {
	publisher    bool
	topic, group string
	key          attribute.Key
	value        string
}

var _ pgoutbox.Observer = (*Observer)(nil)

// NewObserver creates the instruments and returns an Observer feeding
// them.
func NewObserver(opts MetricsOptions) (*Observer, error) {
	m := opts.meter()
	o := &Observer{attrs: opts.Attributes, sets: map[setKey]metric.MeasurementOption{}}
	for _, c := range []struct {
		dst        *metric.Int64Counter
		name, unit string
		desc       string
	}{
		{&o.published, "pgoutbox.publisher.published", "{message}", "Messages inserted into the outbox by Publish calls."},
		{&o.claims, "pgoutbox.subscriber.claims", "{claim}", "Claim statements run by subscribers, empty ones included."},
		{&o.claimed, "pgoutbox.subscriber.claimed", "{message}", "Rows claimed by subscribers: leased, or locked by a held claim."},
		{&o.heldClaimed, "pgoutbox.subscriber.held_claimed", "{message}", "Rows claimed on the held path (locked in a transaction kept open while handled)."},
		{&o.heldToLease, "pgoutbox.subscriber.held_to_lease", "{message}", "Rows of held claims that became ordinary leases (a handler outlived the bound, a nack, a dead letter)."},
		{&o.acked, "pgoutbox.subscriber.acked", "{message}", "Acks written (rows deleted)."},
		{&o.retried, "pgoutbox.subscriber.retried", "{message}", "Nacks written: the row is due again after its retry delay."},
		{&o.released, "pgoutbox.subscriber.released", "{message}", "Leases given back without a delivery outcome (at shutdown, or a prefetched row waited too long)."},
		{&o.deadLettered, "pgoutbox.subscriber.dead_lettered", "{message}", "Rows moved to the dead-letter table (or parked), per failure reason."},
		{&o.poisoned, "pgoutbox.subscriber.poisoned", "{message}", "Rows that could not be decoded into a message."},
		{&o.renewed, "pgoutbox.subscriber.leases_renewed", "{lease}", "In-flight leases extended."},
		{&o.leaseLost, "pgoutbox.subscriber.leases_lost", "{lease}", "Writes that found their lease taken by another consumer, per write (ack, nack, release, renew, dead_letter), held batches that did not commit (commit), and acks written again after a lost reply that found their rows gone (ack_unanswered)."},
	} {
		ctr, err := m.Int64Counter(c.name, metric.WithUnit(c.unit), metric.WithDescription(c.desc))
		if err != nil {
			return nil, fmt.Errorf("pgoutboxotel: create %s: %w", c.name, err)
		}
		*c.dst = ctr
	}
	buckets := opts.LatenessBuckets
	if buckets == nil {
		buckets = DefaultLatenessBuckets
	}
	var err error
	o.lateness, err = m.Float64Histogram("pgoutbox.subscriber.lateness", metric.WithUnit("s"),
		metric.WithDescription("How long after it became due a message was handed to the Router: for a message neither delayed nor retried, the time from its publish (its transaction's start) to its hand-out."),
		metric.WithExplicitBucketBoundaries(buckets...))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.subscriber.lateness: %w", err)
	}
	return o, nil
}

// Observe implements pgoutbox.Observer.
func (o *Observer) Observe(e pgoutbox.Event) {
	ctx := context.Background()
	switch e.Kind {
	case pgoutbox.EventPublished:
		if e.Count > 0 {
			o.published.Add(ctx, int64(e.Count), o.set(setKey{publisher: true, topic: e.Topic}))
		}
	case pgoutbox.EventClaimed:
		set := o.set(setKey{topic: e.Topic, group: e.Group})
		o.claims.Add(ctx, 1, set)
		if e.Count > 0 {
			o.claimed.Add(ctx, int64(e.Count), set)
			if e.Path == pgoutbox.PathHeld {
				o.heldClaimed.Add(ctx, int64(e.Count), set)
			}
		}
	case pgoutbox.EventHeldToLease:
		if e.Count > 0 {
			o.heldToLease.Add(ctx, int64(e.Count), o.set(setKey{topic: e.Topic, group: e.Group}))
		}
	case pgoutbox.EventHandedOut:
		o.lateness.Record(ctx, max(e.Lateness, 0).Seconds(), o.set(setKey{topic: e.Topic, group: e.Group}))
	case pgoutbox.EventAcked:
		o.acked.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group}))
	case pgoutbox.EventRetried:
		o.retried.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group}))
	case pgoutbox.EventReleased:
		o.released.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group}))
	case pgoutbox.EventDeadLettered:
		o.deadLettered.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group, key: ReasonKey, value: e.Reason}))
	case pgoutbox.EventPoisoned:
		o.poisoned.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group}))
	case pgoutbox.EventLeaseRenewed:
		if e.Count > 0 {
			o.renewed.Add(ctx, int64(e.Count), o.set(setKey{topic: e.Topic, group: e.Group}))
		}
	case pgoutbox.EventLeaseLost:
		o.leaseLost.Add(ctx, rows(e), o.set(setKey{topic: e.Topic, group: e.Group, key: PhaseKey, value: e.Phase}))
	}
}

// set returns the measurement option of k's attributes, built once per
// combination: counting an event then allocates nothing.
func (o *Observer) set(k setKey) metric.MeasurementOption {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.sets[k]; ok {
		return s
	}
	attrs := append([]attribute.KeyValue{semconv.MessagingSystemKey.String(System), semconv.MessagingDestinationName(k.topic)}, o.attrs...)
	if !k.publisher {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(k.group))
	}
	if k.key != "" {
		attrs = append(attrs, k.key.String(k.value))
	}
	s := metric.WithAttributeSet(attribute.NewSet(attrs...))
	o.sets[k] = s
	return s
}

// rows is the number of rows a row event stands for: one, unless a future
// version batches them in Count.
func rows(e pgoutbox.Event) int64 {
	if e.Count > 1 {
		return int64(e.Count)
	}
	return 1
}

// RegisterStats creates observable gauges over pgoutbox.Stats and
// pgoutbox.Health of the outbox named by tables, read through exec (a
// pool: tx.FromPgxPool or tx.FromSQLDB), once per collection of the
// meter's readers:
//
//	pgoutbox.messages{state}            rows per topic, group and state
//	pgoutbox.oldest_ready_age           the oldest ready row's age: the group's lag, the one to alert on
//	pgoutbox.unbound_messages           rows of a group not bound to the topic: alert on > 0
//	pgoutbox.dead_letters{reason}       dead letters per topic, group and reason
//	pgoutbox.consumer_group.paused      1 while the group is paused, else 0
//	pgoutbox.table.live_tuples{table}   estimated live rows of the outbox, its dead-letter and arrivals tables
//	pgoutbox.table.dead_tuples{table}   estimated dead rows vacuum has not removed yet
//	pgoutbox.table.size{table}          the table's bytes with TOAST; a queue's should stay flat
//	pgoutbox.table.index_size{table}    its indexes' bytes
//	pgoutbox.oldest_snapshot.age{kind}  how long the oldest transaction of each kind (backend, prepared_xact)
//	                                    has held back vacuum of the outbox: alert above 10 minutes
//	pgoutbox.oldest_snapshot.xmin_age{kind}  transactions begun since the oldest snapshot of each kind
//	                                    (backend, replication_slot, prepared_xact)
//	pgoutbox.ring.current.age{table}    a rotating outbox's current partition's age: alert above a minute
//	pgoutbox.ring.partition.rows{table, generation}  each ring partition's estimated live rows
//	pgoutbox.stats.errors               collections whose Stats or Health call failed or timed out
//	                                    (they report none of the failed call's gauges)
//	pgoutbox.stats.duration             how long the last Stats and Health calls took
//
// Stats costs about 300 ms on an outbox of 1,000,000 rows: collect every
// 15 to 60 seconds (the periodic reader's interval). Unregister the
// returned registration to stop. A nil exec or invalid table names are an
// error (ErrInvalidConfig), nothing registered.
func RegisterStats(exec tx.Executor, tables schema.Config, opts MetricsOptions) (metric.Registration, error) {
	if exec == nil {
		return nil, fmt.Errorf("%w: pgoutboxotel: executor is nil; pass tx.FromPgxPool(pool) or another tx executor", pgoutbox.ErrInvalidConfig)
	}
	if err := tables.Validate(); err != nil {
		return nil, fmt.Errorf("%w: pgoutboxotel: %w", pgoutbox.ErrInvalidConfig, err)
	}
	if opts.StatsTimeout > 0 && opts.StatsTimeout < pgoutbox.MinDuration {
		return nil, fmt.Errorf("%w: pgoutboxotel: StatsTimeout is %s; it must be at least %s (a bare number is nanoseconds: write %d * time.Second)",
			pgoutbox.ErrInvalidConfig, opts.StatsTimeout, pgoutbox.MinDuration, int64(opts.StatsTimeout))
	}
	m := opts.meter()
	timeout := opts.StatsTimeout
	if timeout <= 0 {
		timeout = DefaultStatsTimeout
	}
	logger := opts.Logger
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	messages, err := m.Int64ObservableGauge("pgoutbox.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Rows of the outbox per topic, consumer group and state (ready, scheduled, leased, expired_lease, parked)."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.messages: %w", err)
	}
	oldest, err := m.Float64ObservableGauge("pgoutbox.oldest_ready_age", metric.WithUnit("s"),
		metric.WithDescription("How long the oldest ready row of the consumer group has been due (its lag); 0 when nothing is ready."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.oldest_ready_age: %w", err)
	}
	dead, err := m.Int64ObservableGauge("pgoutbox.dead_letters", metric.WithUnit("{message}"),
		metric.WithDescription("Rows of the dead-letter table per topic, consumer group and failure reason."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.dead_letters: %w", err)
	}
	unbound, err := m.Int64ObservableGauge("pgoutbox.unbound_messages", metric.WithUnit("{message}"),
		metric.WithDescription("Rows of a consumer group that is not bound to the topic: messages no bound group will consume (alert on > 0; for the default group, messages published while nothing was bound, which the next group to bind gets)."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.unbound_messages: %w", err)
	}
	paused, err := m.Int64ObservableGauge("pgoutbox.consumer_group.paused", metric.WithUnit("1"),
		metric.WithDescription("1 while the consumer group is paused on the topic (its lag grows by design), else 0."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.consumer_group.paused: %w", err)
	}
	statsErrors, err := m.Int64ObservableCounter("pgoutbox.stats.errors", metric.WithUnit("{call}"),
		metric.WithDescription("Collections whose pgoutbox.Stats or pgoutbox.Health call failed or timed out (they report none of the failed call's gauges)."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.stats.errors: %w", err)
	}
	duration, err := m.Float64ObservableGauge("pgoutbox.stats.duration", metric.WithUnit("s"),
		metric.WithDescription("How long the last pgoutbox.Stats and pgoutbox.Health calls took."))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxotel: create pgoutbox.stats.duration: %w", err)
	}
	h, err := newHealthGauges(m)
	if err != nil {
		return nil, err
	}
	base := metric.WithAttributes(append([]attribute.KeyValue{semconv.MessagingSystemKey.String(System)}, opts.Attributes...)...)
	var failed atomic.Int64
	var mu sync.Mutex // one Stats call at a time
	return m.RegisterCallback(func(ctx context.Context, obs metric.Observer) error {
		mu.Lock()
		defer mu.Unlock()
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		start := time.Now()
		// Health first: behind an exclusive lock on the outbox it answers
		// (TableHealth.Locked) where Stats waits out the timeout.
		health, healthErr := pgoutbox.Health(ctx, exec, tables)
		stats, err := pgoutbox.Stats(ctx, exec, tables, opts.StatsOptions...)
		obs.ObserveFloat64(duration, time.Since(start).Seconds(), base)
		if err != nil || healthErr != nil {
			failed.Add(1) // one failed collection, as pgoutboxprom counts a failed scrape
		}
		for _, e := range []error{err, healthErr} {
			if e != nil {
				logger.Error("pgoutbox stats for OpenTelemetry failed", e, nil)
			}
		}
		obs.ObserveInt64(statsErrors, failed.Load(), base)
		if healthErr == nil {
			h.observe(obs, health, opts.Attributes)
		}
		if err != nil {
			return nil // counted; no stale gauges
		}
		for _, s := range stats {
			pair := append([]attribute.KeyValue{
				semconv.MessagingSystemKey.String(System),
				semconv.MessagingDestinationName(s.Topic),
				semconv.MessagingConsumerGroupName(s.ConsumerGroup),
			}, opts.Attributes...)
			for _, v := range [...]struct {
				state string
				n     int64
			}{
				{"ready", s.Ready},
				{"scheduled", s.Scheduled},
				{"leased", s.Leased},
				{"expired_lease", s.ExpiredLeases},
				{"parked", s.Parked},
			} {
				obs.ObserveInt64(messages, v.n, metric.WithAttributes(append(pair, StateKey.String(v.state))...))
			}
			obs.ObserveFloat64(oldest, s.OldestReadyAge.Seconds(), metric.WithAttributes(pair...))
			obs.ObserveInt64(unbound, s.Unbound(), metric.WithAttributes(pair...))
			var isPaused int64
			if s.Paused {
				isPaused = 1
			}
			obs.ObserveInt64(paused, isPaused, metric.WithAttributes(pair...))
			for reason, n := range s.DeadLetters {
				obs.ObserveInt64(dead, n, metric.WithAttributes(append(pair, ReasonKey.String(reason))...))
			}
		}
		return nil
	}, append([]metric.Observable{messages, oldest, unbound, dead, paused, statsErrors, duration}, h.instruments()...)...)
}

// healthGauges are the gauges of pgoutbox.Health: the tables' sizes and
// the oldest snapshot holders, as pgoutboxprom's Collector has them.
type healthGauges struct {
	live, dead, size, indexSize metric.Int64ObservableGauge
	snapshotAge                 metric.Float64ObservableGauge
	snapshotXmin                metric.Int64ObservableGauge
	ringAge                     metric.Float64ObservableGauge
	ringRows                    metric.Int64ObservableGauge
}

func newHealthGauges(m metric.Meter) (healthGauges, error) {
	var h healthGauges
	var err error
	ints := []struct {
		to         *metric.Int64ObservableGauge
		name, unit string
		desc       string
	}{
		{&h.live, "pgoutbox.table.live_tuples", "{row}", "Estimated live rows of the table (n_live_tup)."},
		{&h.dead, "pgoutbox.table.dead_tuples", "{row}", "Estimated dead rows vacuum has not removed yet (n_dead_tup): alert when they keep growing across autovacuum runs."},
		{&h.size, "pgoutbox.table.size", "By", "The table's size with TOAST (pg_table_size): a queue's should stay flat."},
		{&h.indexSize, "pgoutbox.table.index_size", "By", "The size of the table's indexes (pg_indexes_size)."},
		{&h.snapshotXmin, "pgoutbox.oldest_snapshot.xmin_age", "{transaction}", "Transactions begun since the oldest snapshot of each kind (backend, replication_slot, prepared_xact); 0 for a kind with none."},
		{&h.ringRows, "pgoutbox.ring.partition.rows", "{row}", "A rotating outbox only: each ring partition's estimated live rows, by generation."},
	}
	for _, g := range ints {
		if *g.to, err = m.Int64ObservableGauge(g.name, metric.WithUnit(g.unit), metric.WithDescription(g.desc)); err != nil {
			return h, fmt.Errorf("pgoutboxotel: create %s: %w", g.name, err)
		}
	}
	h.snapshotAge, err = m.Float64ObservableGauge("pgoutbox.oldest_snapshot.age", metric.WithUnit("s"),
		metric.WithDescription("How long the oldest transaction of each kind (backend, prepared_xact) has held back vacuum of the outbox; 0 for a kind with none, nothing when no holder's time is known (another role's sessions, seen without pg_read_all_stats or pg_monitor; a replica's feedback), the oldest known one otherwise (pgoutbox.oldest_snapshot.xmin_age shows them all). Alert above 10 minutes: pgoutbox health names it."))
	if err != nil {
		return h, fmt.Errorf("pgoutboxotel: create pgoutbox.oldest_snapshot.age: %w", err)
	}
	h.ringAge, err = m.Float64ObservableGauge("pgoutbox.ring.current.age", metric.WithUnit("s"),
		metric.WithDescription("A rotating outbox only: how long the ring's current partition has taken the new rows. Alert above a minute: the next partition cannot be emptied (pgoutbox health says what holds it), or no subscriber runs."))
	if err != nil {
		return h, fmt.Errorf("pgoutboxotel: create pgoutbox.ring.current.age: %w", err)
	}
	return h, nil
}

func (h healthGauges) instruments() []metric.Observable {
	return []metric.Observable{h.live, h.dead, h.size, h.indexSize, h.snapshotAge, h.snapshotXmin, h.ringAge, h.ringRows}
}

// observe reports r. A kind of holder with none reports 0, so that an
// alert resolves rather than going stale; holders of catalog rows only do
// not hold the outbox back.
func (h healthGauges) observe(obs metric.Observer, r pgoutbox.HealthReport, extra []attribute.KeyValue) {
	with := func(kv attribute.KeyValue) metric.ObserveOption {
		return metric.WithAttributes(append([]attribute.KeyValue{semconv.MessagingSystemKey.String(System), kv}, extra...)...)
	}
	for _, t := range []*pgoutbox.TableHealth{&r.Outbox, r.DeadLetters, r.Arrivals} {
		if t == nil {
			continue
		}
		table := with(TableKey.String(t.Table))
		obs.ObserveInt64(h.live, t.LiveTuples, table)
		obs.ObserveInt64(h.dead, t.DeadTuples, table)
		if t.Locked {
			continue // its sizes were not read: no sample, not a drop to 0
		}
		obs.ObserveInt64(h.size, t.TableBytes, table)
		obs.ObserveInt64(h.indexSize, t.IndexBytes, table)
	}
	if ring := r.Ring; ring != nil {
		table := TableKey.String(r.Outbox.Table)
		if ring.Current >= 0 {
			obs.ObserveFloat64(h.ringAge, ring.CurrentFor.Seconds(), with(table))
		}
		for g, n := range ring.Rows {
			obs.ObserveInt64(h.ringRows, n, metric.WithAttributes(append([]attribute.KeyValue{
				semconv.MessagingSystemKey.String(System), table, GenerationKey.Int(g)}, extra...)...))
		}
	}
	age := map[pgoutbox.SnapshotKind]time.Duration{pgoutbox.SnapshotBackend: 0, pgoutbox.SnapshotPreparedXact: 0}
	xmin := map[pgoutbox.SnapshotKind]int64{pgoutbox.SnapshotBackend: 0, pgoutbox.SnapshotReplicationSlot: 0, pgoutbox.SnapshotPreparedXact: 0}
	// Whether a kind has holders with a time, and holders whose time is
	// unknown (another role's session seen without pg_read_all_stats; a
	// replica's feedback).
	timed, untimed := map[pgoutbox.SnapshotKind]bool{}, map[pgoutbox.SnapshotKind]bool{}
	for _, s := range r.SnapshotHolders {
		if s.CatalogOnly {
			continue
		}
		if _, ok := age[s.Kind]; ok {
			if s.Since.IsZero() {
				untimed[s.Kind] = true
			} else {
				age[s.Kind] = max(age[s.Kind], s.Age)
				timed[s.Kind] = true
			}
		}
		if _, ok := xmin[s.Kind]; ok {
			xmin[s.Kind] = max(xmin[s.Kind], s.XminAge)
		}
	}
	for k, d := range age {
		if untimed[k] && !timed[k] {
			// Held back, for a time nobody here can know: no point
			// rather than 0, which reads as "none". With a timed holder
			// too, its age is a lower bound, and still trips an alert.
			continue
		}
		obs.ObserveFloat64(h.snapshotAge, d.Seconds(), with(SnapshotKindKey.String(string(k))))
	}
	for k, n := range xmin {
		obs.ObserveInt64(h.snapshotXmin, n, with(SnapshotKindKey.String(string(k))))
	}
}
