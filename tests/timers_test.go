package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func TestDeliverAfterIsInvisibleUntilDue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev })
	m := newMsg("later")
	pgoutbox.DeliverAfter(m, 1500*time.Millisecond)
	start := time.Now()
	b.publishInTx(t, "t", true, m)

	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	require.Zero(t, ev.wait(t, pgoutbox.EventClaimed, 10*time.Second).Count, "the first claim must not see a row due later")
	got := receive(t, ch, 10*time.Second)
	require.Equal(t, m.UUID, got.UUID)
	require.GreaterOrEqual(t, time.Since(start), 1500*time.Millisecond)
	_, present := got.Metadata["_pgoutbox_deliver_after"]
	require.False(t, present, "scheduling instructions are not stored with the message")
	got.Ack()
}

// A time whose zone's offset has seconds (a historical zone's local mean
// time) is stored at its instant: RFC 3339 cannot write such an offset.
func TestDeliverAtAnOffsetWithSeconds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	at := time.Date(2030, 1, 2, 3, 4, 5, 123456000, time.FixedZone("LMT", 5*3600+30*60+17))
	m := newMsg("x")
	pgoutbox.DeliverAt(m, at)
	b.publishInTx(t, "t", true, m)
	var stored time.Time
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT available_at FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID).Scan(&stored))
	require.True(t, at.Equal(stored), "stored %s for %s", stored, at)
}

// Times RFC 3339 cannot write: one before year 1 is in the past, so now;
// one after 9999 is refused, saying which years DeliverAt takes.
func TestDeliverAtBeyondRFC3339sYears(t *testing.T) {
	t.Parallel()
	b := setup(t)
	early, late := newMsg("early"), newMsg("late")
	pgoutbox.DeliverAt(early, time.Date(-5, 1, 1, 0, 0, 0, 0, time.UTC))
	pgoutbox.DeliverAt(late, time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC))
	pub := b.poolPublisher(t)
	err := pub.Publish("t", late)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
	require.ErrorContains(t, err, "from year 1 to 9999")
	require.Zero(t, b.outboxRows(t, "t"))
	require.NoError(t, pub.Publish("t", early))
	var pastIsNow bool
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT available_at = created_at FROM `+b.Schema+`.outbox WHERE uuid = $1`, early.UUID).Scan(&pastIsNow))
	require.True(t, pastIsNow, "a time before year 1 is in the past: now")
}

// A row due centuries ahead (DeliverAt takes years up to 9999) is further
// than a time.Duration reaches: the wait until it must not wrap to an
// idle loop that claims every millisecond. Idle polls are a minute
// apart here.
func TestARowDueCenturiesAheadLetsAnIdleLoopSleep(t *testing.T) {
	onEachClaimMode(t, func(t *testing.T, mode pgoutbox.ClaimMode) {
		b := setup(t)
		m := newMsg("far")
		pgoutbox.DeliverAt(m, time.Date(9999, 6, 1, 0, 0, 0, 0, time.UTC))
		b.publishInTx(t, "t", true, m)
		ev := newEvents()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Observer, c.ClaimMode = ev, mode
			c.Lease, c.MinPollInterval, c.MaxPollInterval = 10*time.Minute, time.Minute, time.Minute
		})
		_, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		require.Zero(t, ev.wait(t, pgoutbox.EventClaimed, 10*time.Second).Count)
		// After a start, a loop looks again at doubling intervals up to
		// half a second (about 10 looks), then sleeps for its poll; a
		// wrapped wait made it claim every millisecond (over 1,000 claims
		// in these two seconds).
		time.Sleep(2 * time.Second)
		require.Less(t, ev.countKind(pgoutbox.EventClaimed), 20)
	})
}

func TestDeliverAt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	first, past, future := newMsg("first"), newMsg("past"), newMsg("future")
	at := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	pgoutbox.DeliverAt(past, time.Now().Add(-time.Hour))
	pgoutbox.DeliverAt(future, at)
	b.publishInTx(t, "t", true, first)
	b.publishInTx(t, "t", true, past, future)

	var stored time.Time
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at FROM `+b.Schema+`.outbox WHERE uuid = $1`, future.UUID).Scan(&stored))
	require.True(t, at.Equal(stored), "an absolute time is stored as given: %s vs %s", at, stored)
	var pastIsNow bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at = created_at FROM `+b.Schema+`.outbox WHERE uuid = $1`, past.UUID).Scan(&pastIsNow))
	require.True(t, pastIsNow, "a time in the past means now (it does not jump the queue)")

	sub := b.subscriber(t, nil)
	ch, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	for _, want := range []string{"first", "past"} {
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, want, string(m.Payload))
		m.Ack()
	}
}

func TestDedupKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	keyed := func(topic, payload string) *message.Message {
		m := newMsg(payload)
		pgoutbox.WithDedupKey(m, "remind-order-42")
		pgoutbox.DeliverAfter(m, time.Hour)
		return m
	}

	res, err := pub.PublishWithResult("reminders", keyed("reminders", "1st"), keyed("reminders", "dup in call"))
	require.NoError(t, err)
	require.NotZero(t, res.IDs[0])
	require.Equal(t, []int{1}, res.Skipped())
	res, err = pub.PublishWithResult("reminders", keyed("reminders", "2nd call"))
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped())
	res, err = pub.PublishWithResult("other-topic", keyed("other-topic", "independent"))
	require.NoError(t, err)
	require.Empty(t, res.Skipped(), "the same key on another topic is independent")
	require.Equal(t, 1, b.outboxRows(t, "reminders"))

	var payload string
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT convert_from(payload, 'UTF8') FROM `+b.Schema+`.outbox WHERE topic = 'reminders'`).Scan(&payload))
	require.Equal(t, "1st", payload)

	// Once the row is gone (delivered and acked, or cancelled) the key is
	// free again.
	cancelled, err := pub.CancelScheduled(ctx, "reminders", "remind-order-42")
	require.NoError(t, err)
	require.True(t, cancelled)
	res, err = pub.PublishWithResult("reminders", keyed("reminders", "after"))
	require.NoError(t, err)
	require.Empty(t, res.Skipped())
}

func TestDedupKeyIsFreeAfterDelivery(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := b.poolPublisher(t)
	sub := b.subscriber(t, nil)
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	for i := range 2 {
		m := newMsg(fmt.Sprint(i))
		pgoutbox.WithDedupKey(m, "k")
		res, err := pub.PublishWithResult("t", m)
		require.NoError(t, err)
		require.Empty(t, res.Skipped(), "publish %d", i)
		got := receive(t, ch, 10*time.Second)
		require.Equal(t, fmt.Sprint(i), string(got.Payload))
		got.Ack()
		require.Eventually(t, func() bool { return b.outboxRows(t, "t") == 0 }, 10*time.Second, 5*time.Millisecond)
	}
}

func TestCancelScheduled(t *testing.T) {
	t.Parallel()
	t.Run("before due: cancelled, never delivered", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		ctx := context.Background()
		m := newMsg("cancel me")
		pgoutbox.WithDedupKey(m, "timer-1")
		pgoutbox.DeliverAfter(m, 300*time.Millisecond)
		// Cancel in the caller's transaction, like the publish.
		pgTx, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", m))
		ok, err := pub.CancelScheduled(ctx, "t", "timer-1")
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, pgTx.Commit(ctx))

		after := newMsg("after")
		pgoutbox.DeliverAfter(after, 600*time.Millisecond)
		b.publishInTx(t, "t", true, after)
		sub := b.subscriber(t, nil)
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		// The cancelled timer was due first; only the later one arrives.
		got := receive(t, ch, 10*time.Second)
		require.Equal(t, "after", string(got.Payload))
		got.Ack()
	})
	t.Run("while leased: refused, delivered once", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		ctx := context.Background()
		ev := newEvents()
		m := newMsg("in flight")
		pgoutbox.WithDedupKey(m, "timer-2")
		b.publishInTx(t, "t", true, m)
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev })
		ch, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		got := receive(t, ch, 10*time.Second)

		ok, err := b.poolPublisher(t).CancelScheduled(ctx, "t", "timer-2")
		require.NoError(t, err)
		require.False(t, ok, "a running delivery is not cancelled")
		got.Ack()
		ev.wait(t, pgoutbox.EventAcked, 10*time.Second)
		require.Equal(t, 0, b.outboxRows(t, "t"))
		require.Equal(t, 1, ev.countKind(pgoutbox.EventAcked))
	})
}

// A nacked message with a 300ms backoff comes back after about 300ms, not at
// the next poll (MaxPollInterval is 10s here).
func TestRetryBackoffIsScheduledLikeATimer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 300 * time.Millisecond}
		c.MinPollInterval, c.MaxPollInterval, c.Lease = 10*time.Second, 10*time.Second, 30*time.Second
	})
	b.publishInTx(t, "t", true, newMsg("x"))
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	receive(t, ch, 10*time.Second).Nack()
	nacked := time.Now()
	m := receive(t, ch, 5*time.Second)
	require.GreaterOrEqual(t, time.Since(nacked), 300*time.Millisecond-5*time.Millisecond)
	m.Ack()
}

// 200 timers due at random points in the next 3 seconds, on an idle
// subscriber that polls every 10 seconds: every one is delivered and none
// before its time. Lateness is measured by the database clock: the claim
// happened at leased_until - Lease.
func TestTimersFireOnTimeNoneEarly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	lateness := runTimers(t, b, 200, 3*time.Second)
	t.Logf("timer lateness over %d timers: p50 %.2f ms, p99 %.2f ms, max %.2f ms",
		len(lateness), percentile(lateness, 0.50), percentile(lateness, 0.99), percentile(lateness, 1))
}

// runTimers publishes n timers due within span and returns each one's
// lateness in milliseconds (claim time, or for a held claim the time the
// handler ran, minus due time; database clock).
func runTimers(t testing.TB, b *bundle, n int, span time.Duration) []float64 {
	const lease = 30 * time.Second
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
		Tables:          b.tables,
		MaxInFlight:     8,
		Lease:           lease,
		MinPollInterval: 10 * time.Second,
		MaxPollInterval: 10 * time.Second,
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), "timers")
	require.NoError(t, err)

	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = newMsg(fmt.Sprint(i))
		pgoutbox.DeliverAfter(msgs[i], time.Duration(rand.Int64N(int64(span))))
	}
	pub := b.poolPublisher(t)
	for chunk := range slices.Chunk(msgs, 50) {
		require.NoError(t, pub.Publish("timers", chunk...))
	}

	var (
		mu       sync.Mutex
		lateness []float64
		wg       sync.WaitGroup
		early    []string
	)
	deadline := time.After(span + 30*time.Second)
	for range n {
		var m *message.Message
		select {
		case m = <-ch:
		case <-deadline:
			t.Fatalf("only %d of %d timers fired", len(lateness), n)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lateMs float64
			var onTime bool
			// Claimed under a lease: its claim time is leased_until -
			// Lease. Claimed on the held path: no lease; the time it is
			// handled (now) bounds the claim's from above.
			err := b.Pool.QueryRow(context.Background(), `
				SELECT 1000 * extract(epoch FROM coalesce(leased_until - $2 * interval '1 microsecond', clock_timestamp()) - available_at),
				       clock_timestamp() >= available_at
				  FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID, lease.Microseconds()).Scan(&lateMs, &onTime)
			m.Ack()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				early = append(early, m.UUID+": "+err.Error())
				return
			}
			if lateMs < 0 || !onTime {
				early = append(early, fmt.Sprintf("%s fired %.3f ms early", m.UUID, -lateMs))
			}
			lateness = append(lateness, lateMs)
		}()
	}
	wg.Wait()
	require.Empty(t, early)
	require.Len(t, lateness, n)
	return lateness
}

func percentile(xs []float64, p float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	i := int(p*float64(len(s)-1) + 0.5)
	return s[i]
}

// BenchmarkTimerLateness reports timer lateness (database clock) for 200
// timers due at random points in 3 seconds, on a subscriber polling every
// 10 seconds: go test -run '^$' -bench TimerLateness ./tests/
func BenchmarkTimerLateness(bm *testing.B) {
	b := setup(bm)
	var all []float64
	for bm.Loop() {
		all = append(all, runTimers(bm, b, 200, 3*time.Second)...)
	}
	bm.ReportMetric(percentile(all, 0.50), "p50_ms")
	bm.ReportMetric(percentile(all, 0.99), "p99_ms")
	bm.ReportMetric(percentile(all, 1), "max_ms")
}

// A dedup key PostgreSQL text cannot hold went to the server, whose
// encoding error aborted the caller's transaction: CancelScheduled refuses
// it first, as Publish does, and the transaction goes on.
func TestCancelScheduledRefusesAKeyNoMessageCanHave(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pgTx.Rollback(context.Background()) })
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	for _, key := range []string{"a\x00b", "a\xffb"} {
		_, err := pub.CancelScheduled(ctx, "t", key)
		require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
		require.ErrorContains(t, err, "pass the key given to WithDedupKey")
	}
	require.NoError(t, pub.Publish("t", newMsg("still in the transaction")))
	require.NoError(t, pgTx.Commit(ctx))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic = 't'`))
}
