package pgoutboxprom_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pgoutboxprom"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// scrape fetches the exposition text from srv the way Prometheus does.
func scrape(t *testing.T, srv *httptest.Server) string {
	t.Helper()
	resp, err := http.Get(srv.URL)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// requireLine fails unless the exposition text holds line (a sample with
// its labels in Prometheus' order, alphabetical, and its value).
func requireLine(t *testing.T, body, line string) {
	t.Helper()
	for _, l := range strings.Split(body, "\n") {
		if l == line {
			return
		}
	}
	t.Fatalf("scrape has no line %q; it has:\n%s", line, grep(body, "pgoutbox_"))
}

func grep(body, prefix string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func publish(t *testing.T, pub message.Publisher, topic string, n int) {
	t.Helper()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(topic))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
}

func TestCollectorAndObserverOverHTTP(t *testing.T) {
	reg := prometheus.NewRegistry()
	obs, err := pgoutboxprom.NewObserver(reg, pgoutboxprom.Options{})
	require.NoError(t, err)
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{
		Subscriber: func(c *pgoutbox.SubscriberConfig) { c.Observer = obs },
	})
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxprom.Options{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables, Observer: obs}, env.Logger)
	require.NoError(t, err)
	publish(t, pub, "orders", 3)
	publish(t, pub, "payments", 1)

	// Before any consumer: the rows are ready, and the publisher counted them.
	body := scrape(t, srv)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="ready",topic="orders"} 3`)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="leased",topic="orders"} 0`)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="ready",topic="payments"} 1`)
	requireLine(t, body, `pgoutbox_publisher_messages_published_total{topic="orders"} 3`)
	requireLine(t, body, `pgoutbox_publisher_messages_published_total{topic="payments"} 1`)
	requireLine(t, body, `pgoutbox_stats_errors_total 0`)
	require.Contains(t, body, `pgoutbox_oldest_ready_age_seconds{consumer_group="",topic="orders"} `)
	// Nothing is bound yet: the messages are unbound, waiting for the
	// first group to bind.
	requireLine(t, body, `pgoutbox_unbound_messages{consumer_group="",topic="orders"} 3`)
	requireLine(t, body, `pgoutbox_consumer_group_paused{consumer_group="",topic="orders"} 0`)
	require.NoError(t, pgoutbox.PauseGroup(context.Background(), tx.FromPgxPool(env.Pool), env.Tables, "payments", ""))
	requireLine(t, scrape(t, srv), `pgoutbox_consumer_group_paused{consumer_group="",topic="payments"} 1`)
	_, err = pgoutbox.ResumeGroup(context.Background(), tx.FromPgxPool(env.Pool), env.Tables, "payments", "")
	require.NoError(t, err)

	// Consume and ack the orders.
	env.Drain(t, "orders", 3, 10*time.Second) // acks each message
	acked := `pgoutbox_subscriber_messages_acked_total{consumer_group="",topic="orders"} 3`
	require.Eventually(t, func() bool { return strings.Contains(scrape(t, srv), acked+"\n") }, 5*time.Second, 20*time.Millisecond,
		"the observer runs on a goroutine of the subscriber's own: its counters follow the acks")
	body = scrape(t, srv)
	requireLine(t, body, `pgoutbox_subscriber_messages_claimed_total{consumer_group="",topic="orders"} 3`)
	requireLine(t, body, `pgoutbox_subscriber_lateness_seconds_count{consumer_group="",topic="orders"} 3`)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="ready",topic="orders"} 0`)
	requireLine(t, body, `pgoutbox_oldest_ready_age_seconds{consumer_group="",topic="orders"} 0`)
	requireLine(t, body, `pgoutbox_unbound_messages{consumer_group="",topic="orders"} 0`)

	// A payment whose one allowed delivery is nacked is dead-lettered.
	sub := env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{MaxAttempts: 1}
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(ctx, "payments")
	require.NoError(t, err)
	select {
	case m := <-msgs:
		m.Nack()
	case <-time.After(10 * time.Second):
		t.Fatal("no payment delivered")
	}
	dead := `pgoutbox_subscriber_messages_dead_lettered_total{consumer_group="",reason="retry_exhausted",topic="payments"} 1`
	require.Eventually(t, func() bool { return strings.Contains(scrape(t, srv), dead+"\n") }, 5*time.Second, 20*time.Millisecond)
	body = scrape(t, srv)
	requireLine(t, body, `pgoutbox_dead_letters{consumer_group="",reason="retry_exhausted",topic="payments"} 1`)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="ready",topic="payments"} 0`)
	requireLine(t, body, `pgoutbox_stats_errors_total 0`)

	// A second observer on the same registry shares the counters.
	again, err := pgoutboxprom.NewObserver(reg, pgoutboxprom.Options{})
	require.NoError(t, err)
	again.Observe(pgoutbox.Event{Kind: pgoutbox.EventPublished, Topic: "orders", Count: 2})
	requireLine(t, scrape(t, srv), `pgoutbox_publisher_messages_published_total{topic="orders"} 5`)
}

// A failed Stats call counts as an error and exposes no stale gauges.
func TestCollectorStatsError(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	publish(t, env.Publisher, "orders", 1)

	reg := prometheus.NewRegistry()
	good := pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxprom.Options{Subsystem: "good"})
	missing := env.Tables
	missing.Table = "no_such_outbox"
	missing.DeadLetterTable = "no_such_outbox_dlq"
	bad := pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), missing, pgoutboxprom.Options{Subsystem: "bad", ScrapeTimeout: time.Second})
	reg.MustRegister(good, bad)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)

	for i := 1; i <= 2; i++ {
		body := scrape(t, srv)
		requireLine(t, body, `pgoutbox_good_messages{consumer_group="",state="ready",topic="orders"} 1`)
		requireLine(t, body, `pgoutbox_good_stats_errors_total 0`)
		requireLine(t, body, `pgoutbox_bad_stats_errors_total `+string(rune('0'+i)))
		require.NotContains(t, body, "pgoutbox_bad_messages{")
		require.NotContains(t, body, "pgoutbox_bad_oldest_ready_age_seconds{")
	}
	require.Equal(t, 3.0, testutil.ToFloat64(prometheus.CollectorFunc(func(ch chan<- prometheus.Metric) {
		// The counter alone, through the collector's own Collect.
		metrics := make(chan prometheus.Metric, 64)
		bad.Collect(metrics)
		close(metrics)
		for m := range metrics {
			if strings.Contains(m.Desc().String(), "stats_errors_total") {
				ch <- m
			}
		}
	})), "a third scrape, by Collect directly, counted")
}

// A dead-letter table named but missing (a typo in DeadLetterTable) is a
// failed scrape, not a count of no dead letters: the alerts on dead
// letters would stay silent.
func TestCollectorCountsAMissingDeadLetterTableAsAnError(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	publish(t, env.Publisher, "orders", 1)
	typo := env.Tables
	typo.DeadLetterTable = "outbox_dlqq"
	reg := prometheus.NewRegistry()
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), typo, pgoutboxprom.Options{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	requireLine(t, scrape(t, srv), `pgoutbox_stats_errors_total 1`)
}

// Every event kind lands in a counter; Namespace, Subsystem and ConstLabels
// shape the names.
func TestObserverEveryKind(t *testing.T) {
	reg := prometheus.NewRegistry()
	obs, err := pgoutboxprom.NewObserver(reg, pgoutboxprom.Options{Namespace: "app", Subsystem: "outbox", ConstLabels: prometheus.Labels{"db": "main"}})
	require.NoError(t, err)
	for _, e := range []pgoutbox.Event{
		{Kind: pgoutbox.EventPublished, Topic: "t", Count: 4},
		{Kind: pgoutbox.EventClaimed, Topic: "t", Group: "g", Count: 3},
		{Kind: pgoutbox.EventClaimed, Topic: "t", Group: "g", Count: 0},
		{Kind: pgoutbox.EventClaimed, Topic: "t", Group: "g", Count: 5, Path: pgoutbox.PathHeld},
		{Kind: pgoutbox.EventHeldToLease, Topic: "t", Group: "g", Count: 2},
		{Kind: pgoutbox.EventAcked, Topic: "t", Group: "g", RowID: 1},
		{Kind: pgoutbox.EventRetried, Topic: "t", Group: "g", RowID: 2},
		{Kind: pgoutbox.EventReleased, Topic: "t", Group: "g", RowID: 3},
		{Kind: pgoutbox.EventDeadLettered, Topic: "t", Group: "g", RowID: 4, Reason: pgoutbox.ReasonRejected},
		{Kind: pgoutbox.EventPoisoned, Topic: "t", Group: "g", RowID: 5, Err: errors.New("bad json")},
		{Kind: pgoutbox.EventLeaseRenewed, Topic: "t", Group: "g", Count: 2},
		{Kind: pgoutbox.EventLeaseLost, Topic: "t", Group: "g", RowID: 6, Phase: "ack"},
		{Kind: "some_future_kind", Topic: "t"},
	} {
		obs.Observe(e)
	}
	const want = `
# HELP app_outbox_publisher_messages_published_total Messages inserted into the outbox by Publish calls.
# TYPE app_outbox_publisher_messages_published_total counter
app_outbox_publisher_messages_published_total{db="main",topic="t"} 4
# HELP app_outbox_subscriber_claims_total Claim statements run by subscribers, empty ones included.
# TYPE app_outbox_subscriber_claims_total counter
app_outbox_subscriber_claims_total{consumer_group="g",db="main",topic="t"} 3
# HELP app_outbox_subscriber_leases_lost_total Writes that found their lease taken by another consumer, per write (ack, nack, release, renew, dead_letter), and held batches that did not commit (commit).
# TYPE app_outbox_subscriber_leases_lost_total counter
app_outbox_subscriber_leases_lost_total{consumer_group="g",db="main",phase="ack",topic="t"} 1
# HELP app_outbox_subscriber_leases_renewed_total In-flight leases extended.
# TYPE app_outbox_subscriber_leases_renewed_total counter
app_outbox_subscriber_leases_renewed_total{consumer_group="g",db="main",topic="t"} 2
# HELP app_outbox_subscriber_messages_acked_total Acks written (rows deleted).
# TYPE app_outbox_subscriber_messages_acked_total counter
app_outbox_subscriber_messages_acked_total{consumer_group="g",db="main",topic="t"} 1
# HELP app_outbox_subscriber_messages_claimed_total Rows claimed by subscribers: leased, or locked by a held claim.
# TYPE app_outbox_subscriber_messages_claimed_total counter
app_outbox_subscriber_messages_claimed_total{consumer_group="g",db="main",topic="t"} 8
# HELP app_outbox_subscriber_messages_held_claimed_total Rows claimed on the held path (locked in a transaction kept open while handled; see pgoutbox.ClaimMode).
# TYPE app_outbox_subscriber_messages_held_claimed_total counter
app_outbox_subscriber_messages_held_claimed_total{consumer_group="g",db="main",topic="t"} 5
# HELP app_outbox_subscriber_messages_held_to_lease_total Rows of held claims that became ordinary leases (a handler outlived the bound, a nack, a dead letter).
# TYPE app_outbox_subscriber_messages_held_to_lease_total counter
app_outbox_subscriber_messages_held_to_lease_total{consumer_group="g",db="main",topic="t"} 2
# HELP app_outbox_subscriber_messages_dead_lettered_total Rows moved to the dead-letter table (or parked), per failure reason.
# TYPE app_outbox_subscriber_messages_dead_lettered_total counter
app_outbox_subscriber_messages_dead_lettered_total{consumer_group="g",db="main",reason="rejected",topic="t"} 1
# HELP app_outbox_subscriber_messages_poisoned_total Rows that could not be decoded into a message.
# TYPE app_outbox_subscriber_messages_poisoned_total counter
app_outbox_subscriber_messages_poisoned_total{consumer_group="g",db="main",topic="t"} 1
# HELP app_outbox_subscriber_messages_released_total Leases given back without a delivery outcome (at shutdown, or a prefetched row waited too long).
# TYPE app_outbox_subscriber_messages_released_total counter
app_outbox_subscriber_messages_released_total{consumer_group="g",db="main",topic="t"} 1
# HELP app_outbox_subscriber_messages_retried_total Nacks written: the row is due again after its retry delay.
# TYPE app_outbox_subscriber_messages_retried_total counter
app_outbox_subscriber_messages_retried_total{consumer_group="g",db="main",topic="t"} 1
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want)))

	// A hand-out's lateness lands in its bucket.
	obs.Observe(pgoutbox.Event{Kind: pgoutbox.EventHandedOut, Topic: "t", Group: "g", RowID: 7, Deliveries: 1, Lateness: 3 * time.Second})
	obs.Observe(pgoutbox.Event{Kind: pgoutbox.EventHandedOut, Topic: "t", Group: "g", RowID: 8, Deliveries: 1, Lateness: 40 * time.Second})
	const lateness = `
# HELP app_outbox_subscriber_lateness_seconds How long after it became due a message was handed to the Router: for a message neither delayed nor retried, the time from its publish to its hand-out.
# TYPE app_outbox_subscriber_lateness_seconds histogram
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.005"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.01"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.025"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.05"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.1"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.25"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="0.5"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="1"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="2.5"} 0
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="5"} 1
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="10"} 1
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="30"} 1
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="60"} 2
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="300"} 2
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="900"} 2
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="3600"} 2
app_outbox_subscriber_lateness_seconds_bucket{consumer_group="g",db="main",topic="t",le="+Inf"} 2
app_outbox_subscriber_lateness_seconds_sum{consumer_group="g",db="main",topic="t"} 43
app_outbox_subscriber_lateness_seconds_count{consumer_group="g",db="main",topic="t"} 2
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(lateness), "app_outbox_subscriber_lateness_seconds"))

	// A name taken by another kind of collector is an error, not a panic.
	clash := prometheus.NewRegistry()
	clash.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "pgoutbox_subscriber_messages_acked_total", Help: "x"}))
	_, err = pgoutboxprom.NewObserver(clash, pgoutboxprom.Options{})
	require.Error(t, err)
}

// sample returns the value of the sample whose name and labels are
// prefix, failing when the scrape has none.
func sample(t *testing.T, body, prefix string) float64 {
	t.Helper()
	for _, l := range strings.Split(body, "\n") {
		if rest, ok := strings.CutPrefix(l, prefix+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			require.NoError(t, err, l)
			return v
		}
	}
	t.Fatalf("scrape has no sample %s; it has:\n%s", prefix, grep(body, "pgoutbox_"))
	return 0
}

// The Collector exports both tables' tuples and sizes, and the age of the
// oldest snapshot per kind: an open REPEATABLE READ transaction shows as
// a backend's, and the kinds without a holder report 0.
func TestCollectorHealth(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	publish(t, env.Publisher, "orders", 2)
	reg := prometheus.NewRegistry()
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxprom.Options{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)

	ctx := context.Background()
	holder, err := pgx.Connect(ctx, env.DSN)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Close(context.Background()) })
	_, err = holder.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `SELECT txid_current()`) // one transaction after the snapshot
	require.NoError(t, err)

	body := scrape(t, srv)
	outbox, dlq := env.Schema+".outbox", env.Schema+".outbox_dlq"
	for _, table := range []string{outbox, dlq} {
		require.GreaterOrEqual(t, sample(t, body, `pgoutbox_table_dead_tuples{table="`+table+`"}`), 0.0)
		require.GreaterOrEqual(t, sample(t, body, `pgoutbox_table_live_tuples{table="`+table+`"}`), 0.0)
		require.Positive(t, sample(t, body, `pgoutbox_table_bytes{table="`+table+`"}`))
		require.Positive(t, sample(t, body, `pgoutbox_table_index_bytes{table="`+table+`"}`))
	}
	require.Positive(t, sample(t, body, `pgoutbox_oldest_snapshot_age_seconds{kind="backend"}`), "the open transaction's")
	require.GreaterOrEqual(t, sample(t, body, `pgoutbox_oldest_snapshot_xmin_age{kind="backend"}`), 1.0)
	sample(t, body, `pgoutbox_oldest_snapshot_age_seconds{kind="prepared_xact"}`)
	sample(t, body, `pgoutbox_oldest_snapshot_xmin_age{kind="prepared_xact"}`)
	sample(t, body, `pgoutbox_oldest_snapshot_xmin_age{kind="replication_slot"}`)
	require.NotContains(t, body, `pgoutbox_oldest_snapshot_age_seconds{kind="replication_slot"}`, "slots record no time")
	requireLine(t, body, `pgoutbox_stats_errors_total 0`)
	requireLine(t, body, `pgoutbox_messages{consumer_group="",state="ready",topic="orders"} 2`)
	require.NotContains(t, body, "pgoutbox_ring_", "a single table has no ring")
}

// A role without pg_read_all_stats sees other roles' sessions without
// their transaction's start: the oldest snapshot's age is then unknown,
// and the gauge has no backend sample instead of a 0 that reads as none
// (an operator's alert on it would never fire); the xmin age still shows
// the holder.
func TestCollectorHasNoSnapshotAgeItCannotSee(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	ctx := context.Background()
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
	reg := prometheus.NewRegistry()
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(pool), env.Tables, pgoutboxprom.Options{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)

	holder, err := pgx.Connect(ctx, env.DSN) // another role's session
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Close(context.Background()) })
	_, err = holder.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, `SELECT txid_current()`)
	require.NoError(t, err)

	body := scrape(t, srv)
	require.GreaterOrEqual(t, sample(t, body, `pgoutbox_oldest_snapshot_xmin_age{kind="backend"}`), 1.0, "the holder is seen")
	require.NotContains(t, body, `pgoutbox_oldest_snapshot_age_seconds{kind="backend"}`, "its age is unknown to this role")
	sample(t, body, `pgoutbox_oldest_snapshot_age_seconds{kind="prepared_xact"}`)
}

// A rotating outbox's ring: how long its current partition has been, and
// each partition's rows.
func TestCollectorRing(t *testing.T) {
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{Rotating: true})
	reg := prometheus.NewRegistry()
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxprom.Options{}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	body := scrape(t, srv)
	outbox := env.Schema + ".outbox"
	require.GreaterOrEqual(t, sample(t, body, `pgoutbox_ring_current_age_seconds{table="`+outbox+`"}`), 0.0)
	for _, g := range []string{"0", "1", "2"} {
		require.GreaterOrEqual(t, sample(t, body, `pgoutbox_ring_partition_rows{generation="`+g+`",table="`+outbox+`"}`), 0.0)
	}
	requireLine(t, body, `pgoutbox_stats_errors_total 0`)
}

// A nil executor or table names that cannot be an outbox's make every
// scrape fail with the error (promhttp answers 500 with its text), where
// they exported no series and said nothing.
func TestCollectorOfABadConfigurationFailsItsScrapes(t *testing.T) {
	for name, c := range map[string]*pgoutboxprom.Collector{
		"nil executor":   pgoutboxprom.NewCollector(nil, schema.Config{}, pgoutboxprom.Options{}),
		"bad table name": pgoutboxprom.NewCollector(tx.FromPgxPool(nil), schema.Config{Table: "bad-name"}, pgoutboxprom.Options{}),
		"nanoseconds":    pgoutboxprom.NewCollector(tx.FromPgxPool(nil), schema.Config{}, pgoutboxprom.Options{ScrapeTimeout: 5}),
	} {
		reg := prometheus.NewRegistry()
		reg.MustRegister(c)
		_, err := reg.Gather()
		require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig, name)
		srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		resp, err := http.Get(srv.URL)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		srv.Close()
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode, name)
		require.Contains(t, string(body), "pgoutboxprom:", name)
	}
}

// Behind an exclusive lock on the outbox a scrape still has the tables'
// gauges: the tuple counts of every table, the sizes of the tables nobody
// locked (a locked one has no size sample rather than 0), and the queue
// counts, which wait for the lock, are the scrape's error. Stats ran
// first and took the whole ScrapeTimeout, and Health then failed at once:
// no table gauge at all.
func TestCollectorBehindAnExclusiveLock(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	publish(t, env.Publisher, "orders", 2)
	reg := prometheus.NewRegistry()
	reg.MustRegister(pgoutboxprom.NewCollector(tx.FromPgxPool(env.Pool), env.Tables, pgoutboxprom.Options{ScrapeTimeout: time.Second}))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	env.LockOutbox(t)

	body := scrape(t, srv)
	outbox, dlq := env.Schema+".outbox", env.Schema+".outbox_dlq"
	sample(t, body, `pgoutbox_table_live_tuples{table="`+outbox+`"}`)
	require.NotContains(t, body, `pgoutbox_table_bytes{table="`+outbox+`"}`, "not read: no sample")
	require.Positive(t, sample(t, body, `pgoutbox_table_bytes{table="`+dlq+`"}`))
	requireLine(t, body, `pgoutbox_stats_errors_total 1`)
	require.NotContains(t, body, `pgoutbox_messages{`, "the queue counts wait for the lock")
}
