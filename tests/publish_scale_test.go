package tests

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// A NOTIFY in a transaction takes a database-wide lock at commit, which
// serializes the commits of every transaction that notified. A burst of
// concurrent publishing transactions must therefore notify rarely: at most
// once per NotifyCooldown per topic from this process. A LISTEN connection
// counts the notifications the burst sent; every message still arrives.
func TestConcurrentPublishesRarelyNotify(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	listen, err := pgx.Connect(ctx, b.DSN)
	require.NoError(t, err)
	defer listen.Close(context.Background())
	_, err = listen.Exec(ctx, `LISTEN `+pgx.Identifier{b.names(t).Channel}.Sanitize())
	require.NoError(t, err)

	const (
		publishers = 16
		each       = 40
		cooldown   = 50 * time.Millisecond // longer than the default: bounds the count regardless of speed
	)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, publishers)
	for range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				err := tx.RunInTx(ctx, tx.FromPgxPool(b.Pool), func(e tx.Executor) error {
					pub, err := pgoutbox.NewPublisher(e, pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: cooldown}, nil)
					if err != nil {
						return err
					}
					return pub.Publish("t", newMsg(string(rune('a'+i%26))))
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, publishers*each, b.outboxRows(t, "t"))

	// Count what arrived; a last notification may still be on its way.
	notified := 0
	for {
		waitCtx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		_, err := listen.WaitForNotification(waitCtx)
		cancel()
		if err != nil {
			break
		}
		notified++
	}
	bound := int(elapsed/cooldown) + 1
	t.Logf("publishes=%d notifications=%d (at most %d: one per %s over %s)", publishers*each, notified, bound, cooldown, elapsed.Round(time.Millisecond))
	require.Positive(t, notified, "the first publish wakes subscribers")
	require.LessOrEqual(t, notified, bound)
	require.Less(t, notified, publishers*each/4)
}

// The wake-up is not lost with the notifying transaction. A transaction
// that notified rolls back; one published right after it, quietly (within
// the cooldown), commits: an idle subscriber still gets that message, at
// its next poll at the latest. The poll interval is the stated bound.
func TestQuietPublishAfterARolledBackNotifyIsPickedUpByThePoll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ev := newEvents()
	const poll = time.Second
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MinPollInterval, c.MaxPollInterval, c.Observer = poll, poll, ev
	})
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	// Idle for good: after a wake-up (the LISTEN connection's start wakes
	// every loop) a loop looks again a couple of times before it sleeps
	// its poll interval. Wait for an empty claim that came a poll after
	// the one before it: the loop sleeps whole polls now.
	last := time.Now()
	for {
		waitEmptyClaim(t, ev)
		if time.Since(last) > poll/2 {
			break
		}
		last = time.Now()
	}

	// A long cooldown makes sure the second publish is the quiet one.
	cfg := pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: time.Hour}
	publish := func(commit bool) string {
		t.Helper()
		msg := newMsg("x")
		pgxTx, err := b.Pool.Begin(ctx)
		require.NoError(t, err)
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgxTx), cfg, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", msg))
		if commit {
			require.NoError(t, pgxTx.Commit(ctx))
		} else {
			require.NoError(t, pgxTx.Rollback(ctx))
		}
		return msg.UUID
	}
	publish(false) // notified, rolled back: the wake-up vanishes
	sent := time.Now()
	want := publish(true)
	got := receive(t, msgs, 10*poll)
	require.Equal(t, want, got.UUID)
	got.Ack()
	t.Logf("picked up after %s (poll %s)", time.Since(sent).Round(time.Millisecond), poll)
	require.Less(t, time.Since(sent), 3*poll, "within the poll interval (jitter ±20%%), with room for a loaded machine")
}

// Rows published quietly right after a notifying publish are found without
// waiting for the idle poll: a subscriber woken by a publisher looks again
// shortly after its claims run dry.
func TestQuietPublishesAfterAWakeUpAreFoundSoon(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ev := newEvents()
	sub := b.subscriber(t, idleSubscriber(ev)) // 30s poll
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	waitEmptyClaim(t, ev)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: time.Hour}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", newMsg("notifies")))
	receive(t, msgs, wakeBound).Ack()
	// The wake-up's claims found the first row and then nothing: the loop
	// went idle. This row comes quietly (within the cooldown).
	waitEmptyClaim(t, ev)
	require.NoError(t, pub.Publish("t", newMsg("quiet")))
	got := receive(t, msgs, wakeBound) // far below the 30s poll
	require.Equal(t, "quiet", string(got.Payload))
	got.Ack()
}

// A wake-up lost with the LISTEN connection: a message published while the
// subscriber's LISTEN connection is down is claimed once the notifier is
// back (it wakes every loop after each reconnect), long before the idle
// poll.
func TestMessageIsClaimedAfterTheListenConnectionCameBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	app := "listen-drop-" + watermill.NewShortUUID()
	pool := b.namedPool(t, app)
	ev := newEvents()
	c := pgoutbox.SubscriberConfig{Tables: b.tables, DrainTimeout: -1}
	idleSubscriber(ev)(&c) // 30s poll
	logs := &lockedBuffer{}
	sub, err := pgoutbox.NewSubscriber(pool, c, watermill.NewStdLoggerWithOut(logs, false, false))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	listenUp := func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND `+isListenConn, app) == 1
	}
	pollUntil(t, "the LISTEN connection is up", wakeBound, nil, listenUp)
	waitEmptyClaim(t, ev)

	var n int
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid, 2000)) FROM pg_stat_activity
		WHERE application_name = $1 AND `+isListenConn, app).Scan(&n))
	require.Equal(t, 1, n)
	msg := newMsg("while down")
	b.publishInTx(t, "t", true, msg) // its NOTIFY reaches nobody of this subscriber
	got := receive(t, msgs, wakeBound)
	require.Equal(t, msg.UUID, got.UUID)
	got.Ack()
	// The failure was logged as an ERROR; its end is said too.
	require.Contains(t, logs.String(), "LISTEN connection failed")
	pollUntil(t, "the LISTEN connection's return logged", wakeBound, nil, func() bool {
		return strings.Contains(logs.String(), "LISTEN connection is back")
	})
}

// countNotifications drains what the LISTEN connection got so far; a last
// notification may still be on its way, hence the short wait for more.
func countNotifications(t *testing.T, listen *pgx.Conn) int {
	t.Helper()
	n := 0
	for {
		waitCtx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := listen.WaitForNotification(waitCtx)
		cancel()
		if err != nil {
			return n
		}
		n++
	}
}

func listenTo(t *testing.T, b *bundle) *pgx.Conn {
	t.Helper()
	listen, err := pgx.Connect(context.Background(), b.DSN)
	require.NoError(t, err)
	t.Cleanup(func() { listen.Close(context.Background()) })
	_, err = listen.Exec(context.Background(), `LISTEN `+pgx.Identifier{b.names(t).Channel}.Sanitize())
	require.NoError(t, err)
	return listen
}

// The cooldown never silences a scheduled message: subscribers may sleep
// until a time they planned earlier, and only this NOTIFY tells them about
// an earlier one. Nor does a publish that sent nothing (every message
// skipped by its dedup key) hold back the next one's NOTIFY.
func TestCooldownSkipsScheduledAndEmptyPublishes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	listen := listenTo(t, b)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: time.Hour}, nil)
	require.NoError(t, err)

	require.NoError(t, pub.Publish("t", newMsg("notifies")))
	require.NoError(t, pub.Publish("t", newMsg("quiet")))
	require.Equal(t, 1, countNotifications(t, listen), "within the cooldown a plain publish is quiet")

	later := newMsg("later")
	pgoutbox.DeliverAfter(later, time.Minute)
	require.NoError(t, pub.Publish("t", later))
	require.Equal(t, 1, countNotifications(t, listen), "a scheduled message notifies within the cooldown")

	// A fresh topic: its record is untouched. The first keyed publish is
	// made by a publisher outside the cooldown, then this one publishes the
	// same key: skipped, nothing inserted, nothing notified.
	always, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: -1}, nil)
	require.NoError(t, err)
	first := newMsg("keyed")
	pgoutbox.WithDedupKey(first, "k")
	require.NoError(t, always.Publish("u", first))
	require.Equal(t, 1, countNotifications(t, listen))
	again := newMsg("keyed again")
	pgoutbox.WithDedupKey(again, "k")
	res, err := pub.PublishWithResult("u", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped())
	require.Equal(t, 0, countNotifications(t, listen), "a skipped publish sends nothing")
	require.NoError(t, pub.Publish("u", newMsg("after the skip")))
	require.Equal(t, 1, countNotifications(t, listen), "the skipped publish did not start a cooldown")
}

// A quiet publish whose transaction commits a while after the notifying one
// is still found long before the idle poll: the woken subscriber keeps
// looking, at doubling intervals.
func TestQuietPublishCommittedLaterIsFoundByTheLooksAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ev := newEvents()
	sub := b.subscriber(t, idleSubscriber(ev)) // 30s poll
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	waitEmptyClaim(t, ev)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: time.Hour}, nil)
	require.NoError(t, err)
	slow, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	defer slow.Rollback(ctx) //nolint:errcheck // no-op after commit
	require.NoError(t, pub.Publish("t", newMsg("notifies")))
	inTx, err := pgoutbox.NewPublisher(tx.FromPgxTx(slow), pgoutbox.PublisherConfig{Tables: b.tables, NotifyCooldown: time.Hour}, nil)
	require.NoError(t, err)
	require.NoError(t, inTx.Publish("t", newMsg("slow quiet")))
	receive(t, msgs, wakeBound).Ack()
	// The subscriber found nothing more a few times (each within a small
	// fraction of its 30s poll) before the slow transaction commits.
	for range 4 {
		waitEmptyClaim(t, ev)
	}
	require.NoError(t, slow.Commit(ctx))
	got := receive(t, msgs, wakeBound)
	require.Equal(t, "slow quiet", string(got.Payload))
	got.Ack()
}
