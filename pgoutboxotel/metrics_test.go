package pgoutboxotel_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxotel"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// collect reads every metric of reader by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// has reports whether set has every attribute of want.
func has(set attribute.Set, want ...attribute.KeyValue) bool {
	for _, kv := range want {
		if v, ok := set.Value(kv.Key); !ok || v != kv.Value {
			return false
		}
	}
	return true
}

// sum is the value of the counter's data point with the attributes want.
func sum(t *testing.T, m metricdata.Metrics, want ...attribute.KeyValue) int64 {
	t.Helper()
	s, ok := m.Data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	for _, dp := range s.DataPoints {
		if has(dp.Attributes, want...) {
			return dp.Value
		}
	}
	t.Fatalf("%s has no data point with %v", m.Name, want)
	return 0
}

func gauge(t *testing.T, m metricdata.Metrics, want ...attribute.KeyValue) int64 {
	t.Helper()
	g, ok := m.Data.(metricdata.Gauge[int64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	for _, dp := range g.DataPoints {
		if has(dp.Attributes, want...) {
			return dp.Value
		}
	}
	t.Fatalf("%s has no data point with %v", m.Name, want)
	return 0
}

// The lateness histogram records each hand-out's delay after the row's
// due time: two messages whose publish (and due) times are 3 s and 40 s in
// the past land in the buckets (2.5, 5] and (30, 60], summing to about
// 43 s; the counters count the publish, the claims and the acks.
func TestLatenessHistogramAgainstKnownPublishTimes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	obs, err := pgoutboxotel.NewObserver(pgoutboxotel.MetricsOptions{MeterProvider: mp, Attributes: []attribute.KeyValue{attribute.String("outbox", "orders")}})
	require.NoError(t, err)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables, Observer: obs}, nil)
	require.NoError(t, err)
	early, late := message.NewMessage(watermill.NewUUID(), []byte("3s")), message.NewMessage(watermill.NewUUID(), []byte("40s"))
	require.NoError(t, pub.Publish("late", early, late))
	// Published that long ago, by the database's clock.
	for uuid, ago := range map[string]string{early.UUID: "3 s", late.UUID: "40 s"} {
		_, err := env.Pool.Exec(ctx, `UPDATE outbox SET created_at = now() - $2::interval, available_at = now() - $2::interval WHERE uuid = $1`, uuid, ago)
		require.NoError(t, err)
	}

	sub := env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = obs })
	msgs, err := sub.Subscribe(ctx, "late")
	require.NoError(t, err)
	for range 2 {
		select {
		case m := <-msgs:
			m.Ack()
		case <-time.After(10 * time.Second):
			t.Fatal("no message")
		}
	}
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n))
		return n == 0
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, sub.Close()) // the Observer has every event once Close returns

	got := collect(t, reader)
	pair := []attribute.KeyValue{
		attribute.String("messaging.system", "pgoutbox"),
		attribute.String("messaging.destination.name", "late"),
		attribute.String("messaging.consumer.group.name", ""),
		attribute.String("outbox", "orders"),
	}
	h, ok := got["pgoutbox.subscriber.lateness"].Data.(metricdata.Histogram[float64])
	require.True(t, ok)
	require.Len(t, h.DataPoints, 1)
	dp := h.DataPoints[0]
	require.True(t, has(dp.Attributes, pair...), "attributes %v", dp.Attributes.ToSlice())
	require.EqualValues(t, 2, dp.Count)
	require.InDelta(t, 43, dp.Sum, 2, "3 s and 40 s late, plus the time to hand them out")
	bucket := func(upper float64) uint64 {
		for i, b := range dp.Bounds {
			if b == upper {
				return dp.BucketCounts[i]
			}
		}
		t.Fatalf("no bucket bound %v", upper)
		return 0
	}
	require.EqualValues(t, 1, bucket(5), "the 3 s message")
	require.EqualValues(t, 1, bucket(60), "the 40 s message")

	require.EqualValues(t, 2, sum(t, got["pgoutbox.publisher.published"], pair[:2]...))
	require.EqualValues(t, 2, sum(t, got["pgoutbox.subscriber.claimed"], pair...))
	require.EqualValues(t, 2, sum(t, got["pgoutbox.subscriber.acked"], pair...))
	require.Positive(t, sum(t, got["pgoutbox.subscriber.claims"], pair...))
}

// The Stats gauges report the rows per state and the dead letters per
// reason on each collection; a failed Stats call is counted and reports
// no gauges.
func TestStatsGauges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	reg, err := pgoutboxotel.RegisterStats(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxotel.MetricsOptions{MeterProvider: mp})
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Unregister() })

	ready := []*message.Message{
		message.NewMessage(watermill.NewUUID(), []byte("a")),
		message.NewMessage(watermill.NewUUID(), []byte("b")),
		message.NewMessage(watermill.NewUUID(), []byte("c")),
	}
	require.NoError(t, env.Publisher.Publish("gauged", ready...))
	later := message.NewMessage(watermill.NewUUID(), []byte("later"))
	pgoutbox.DeliverAfter(later, time.Hour)
	require.NoError(t, env.Publisher.Publish("gauged", later))
	_, err = env.Pool.Exec(ctx, `INSERT INTO outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason)
		VALUES (1000, 'gauged', '', 'dead', '', '{}', now(), 3, 'rejected')`)
	require.NoError(t, err)

	got := collect(t, reader)
	topic := attribute.String("messaging.destination.name", "gauged")
	require.EqualValues(t, 3, gauge(t, got["pgoutbox.messages"], topic, attribute.String("pgoutbox.state", "ready")))
	require.EqualValues(t, 1, gauge(t, got["pgoutbox.messages"], topic, attribute.String("pgoutbox.state", "scheduled")))
	require.EqualValues(t, 0, gauge(t, got["pgoutbox.messages"], topic, attribute.String("pgoutbox.state", "leased")))
	require.EqualValues(t, 1, gauge(t, got["pgoutbox.dead_letters"], topic, attribute.String("pgoutbox.failure_reason", "rejected")))
	require.EqualValues(t, 0, gauge(t, got["pgoutbox.consumer_group.paused"], topic))
	// Nothing is bound: the four wait for the first group to bind.
	require.EqualValues(t, 4, gauge(t, got["pgoutbox.unbound_messages"], topic))
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(env.Pool), env.Tables, "gauged", ""))
	require.EqualValues(t, 0, gauge(t, collect(t, reader)["pgoutbox.unbound_messages"], topic))
	require.NoError(t, pgoutbox.PauseGroup(ctx, tx.FromPgxPool(env.Pool), env.Tables, "gauged", ""))
	require.EqualValues(t, 1, gauge(t, collect(t, reader)["pgoutbox.consumer_group.paused"], topic))
	age, ok := got["pgoutbox.oldest_ready_age"].Data.(metricdata.Gauge[float64])
	require.True(t, ok)
	require.Len(t, age.DataPoints, 1)
	require.GreaterOrEqual(t, age.DataPoints[0].Value, 0.0)
	require.EqualValues(t, 0, sum(t, got["pgoutbox.stats.errors"]))

	// Health's gauges: the tables, and a transaction that holds a snapshot
	// back by the transactions begun after it.
	outbox := attribute.String("pgoutbox.table", env.Schema+".outbox")
	require.Positive(t, gauge(t, got["pgoutbox.table.size"], outbox), "the outbox holds rows")
	require.Positive(t, gauge(t, got["pgoutbox.table.index_size"], outbox))
	gauge(t, got["pgoutbox.table.live_tuples"], attribute.String("pgoutbox.table", env.Schema+".outbox_dlq"))
	holder, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT txid_current()`)
	require.NoError(t, err)
	for range 3 {
		_, err = env.Pool.Exec(ctx, `SELECT txid_current()`)
		require.NoError(t, err)
	}
	got = collect(t, reader)
	backend := attribute.String("pgoutbox.snapshot_kind", "backend")
	require.GreaterOrEqual(t, gauge(t, got["pgoutbox.oldest_snapshot.xmin_age"], backend), int64(3))
	require.Zero(t, gauge(t, got["pgoutbox.oldest_snapshot.xmin_age"], attribute.String("pgoutbox.snapshot_kind", "prepared_xact")))
	snap, ok := got["pgoutbox.oldest_snapshot.age"].Data.(metricdata.Gauge[float64])
	require.True(t, ok)
	require.Len(t, snap.DataPoints, 2, "backend and prepared_xact, 0 when none")
	require.NoError(t, holder.Rollback(ctx))

	dur, ok := got["pgoutbox.stats.duration"].Data.(metricdata.Gauge[float64])
	require.True(t, ok)
	require.Positive(t, dur.DataPoints[0].Value)
	for _, name := range []string{"pgoutbox.stats.duration", "pgoutbox.stats.errors"} {
		require.True(t, hasSystem(got[name]), "%s has messaging.system, as every measurement", name)
	}
	_, ring := got["pgoutbox.ring.current.age"]
	require.False(t, ring, "a single table has no ring")

	// A pool that is closed: Stats fails.
	closed, err := pgxpool.New(ctx, env.DSN)
	require.NoError(t, err)
	closed.Close()
	failReader := sdkmetric.NewManualReader()
	failing, err := pgoutboxotel.RegisterStats(tx.FromPgxPool(closed), env.Tables,
		pgoutboxotel.MetricsOptions{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(failReader))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = failing.Unregister() })
	got = collect(t, failReader)
	require.EqualValues(t, 1, sum(t, got["pgoutbox.stats.errors"]), "one failed collection, whether Stats, Health or both failed")
	require.EqualValues(t, 2, sum(t, collect(t, failReader)["pgoutbox.stats.errors"]), "a second failed collection")
	for _, name := range []string{"pgoutbox.messages", "pgoutbox.table.size", "pgoutbox.oldest_snapshot.age"} {
		_, reported := got[name]
		require.False(t, reported, "no stale %s after a failed call", name)
	}
}

// A role without pg_read_all_stats sees other roles' sessions without
// their transaction's start: the oldest snapshot's age is unknown, and the
// gauge reports no backend point rather than a 0 that reads as none.
func TestRegisterStatsHasNoSnapshotAgeItCannotSee(t *testing.T) {
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	role := "pgoxt_nomonitor_" + strings.ToLower(watermill.NewShortUUID())
	for _, q := range []string{
		`CREATE ROLE ` + role + ` LOGIN`,
		`GRANT USAGE ON SCHEMA "` + env.Schema + `" TO ` + role,
		`GRANT SELECT ON ALL TABLES IN SCHEMA "` + env.Schema + `" TO ` + role,
	} {
		_, err := env.Pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	t.Cleanup(func() {
		_, _ = env.Pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = env.Pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	cfg, err := pgxpool.ParseConfig(env.DSN)
	require.NoError(t, err)
	cfg.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	reader := sdkmetric.NewManualReader()
	reg, err := pgoutboxotel.RegisterStats(tx.FromPgxPool(pool), env.Tables,
		pgoutboxotel.MetricsOptions{MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Unregister() })

	holder, err := env.Pool.Begin(ctx) // another role's session
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT txid_current()`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `SELECT txid_current()`)
	require.NoError(t, err)

	got := collect(t, reader)
	require.GreaterOrEqual(t, gauge(t, got["pgoutbox.oldest_snapshot.xmin_age"], attribute.String("pgoutbox.snapshot_kind", "backend")), int64(1))
	snap, ok := got["pgoutbox.oldest_snapshot.age"].Data.(metricdata.Gauge[float64])
	require.True(t, ok)
	for _, dp := range snap.DataPoints {
		require.False(t, has(dp.Attributes, attribute.String("pgoutbox.snapshot_kind", "backend")), "a backend age this role cannot know: %v", dp.Value)
	}
	require.Len(t, snap.DataPoints, 1, "prepared_xact's 0")
}

// A rotating outbox's ring: its current partition's age and each
// partition's rows.
func TestRegisterStatsReportsTheRing(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true})
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	reg, err := pgoutboxotel.RegisterStats(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxotel.MetricsOptions{MeterProvider: mp})
	require.NoError(t, err)
	t.Cleanup(func() { _ = reg.Unregister() })
	got := collect(t, reader)
	outbox := attribute.String("pgoutbox.table", env.Schema+".outbox")
	age, ok := got["pgoutbox.ring.current.age"].Data.(metricdata.Gauge[float64])
	require.True(t, ok)
	require.Len(t, age.DataPoints, 1)
	require.GreaterOrEqual(t, age.DataPoints[0].Value, 0.0)
	for g := range 3 {
		require.GreaterOrEqual(t, gauge(t, got["pgoutbox.ring.partition.rows"], outbox, attribute.Int("pgoutbox.generation", g)), int64(0))
	}
}

// A nil executor or table names that cannot be an outbox's are refused,
// nothing registered (they registered gauges that never reported).
func TestRegisterStatsRefusesABadConfiguration(t *testing.T) {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	_, err := pgoutboxotel.RegisterStats(nil, schema.Config{}, pgoutboxotel.MetricsOptions{MeterProvider: mp})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "executor is nil")
	_, err = pgoutboxotel.RegisterStats(tx.FromPgxPool(nil), schema.Config{Table: "bad-name"}, pgoutboxotel.MetricsOptions{MeterProvider: mp})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "bad-name")
	_, err = pgoutboxotel.RegisterStats(tx.FromPgxPool(nil), schema.Config{}, pgoutboxotel.MetricsOptions{MeterProvider: mp, StatsTimeout: 5})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "StatsTimeout is 5ns; it must be at least 1ms")
}

// hasSystem reports whether every data point of m carries
// messaging.system "pgoutbox".
func hasSystem(m metricdata.Metrics) bool {
	var sets []attribute.Set
	switch d := m.Data.(type) {
	case metricdata.Gauge[float64]:
		for _, p := range d.DataPoints {
			sets = append(sets, p.Attributes)
		}
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			sets = append(sets, p.Attributes)
		}
	}
	for _, set := range sets {
		if v, ok := set.Value("messaging.system"); !ok || v.AsString() != pgoutboxotel.System {
			return false
		}
	}
	return len(sets) > 0
}
