package tests

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Rows a crashed consumer held come back at claim speed once their leases
// expired, not one poll interval at a time: the idle loop wakes for an
// expired lease and the claim that follows looks for them. Timing-free:
// while expired rows remain, no claim comes back empty (an empty claim is
// what sends the loop to sleep for a poll interval), and every row is
// delivered (at least once).
func TestExpiredLeasesComeBackAtClaimSpeed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 300
	msgs := newMsgs(n)
	b.publishInTx(t, "t", true, msgs...)
	_, err := b.Pool.Exec(context.Background(), `UPDATE `+b.Schema+`.outbox
		SET lease_token = gen_random_uuid(), leased_until = now() - interval '1 second', leased_by = 'crashed', deliveries = 1`)
	require.NoError(t, err)

	// MaxInFlight 1 and the default 5s poll: one expired row per poll
	// would take 25 minutes.
	var (
		mu     sync.Mutex
		claims []int // the Count of each claim, in order
	)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MinPollInterval, c.MaxPollInterval, c.Lease = time.Second, 5*time.Second, 30*time.Second
		c.Observer = pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
			if e.Kind == pgoutbox.EventClaimed {
				mu.Lock()
				claims = append(claims, e.Count)
				mu.Unlock()
			}
		})
	})
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	seen := map[string]bool{}
	for len(seen) < n {
		m := receive(t, ch, 30*time.Second)
		seen[m.UUID] = true
		m.Ack()
	}
	// The Observer runs on a goroutine of its own: wait for the claims
	// that leased the rows to be reported.
	var got []int
	pollUntil(t, "the claims of every row are observed", 30*time.Second, func() {
		mu.Lock()
		got = append(got[:0], claims...)
		mu.Unlock()
	}, func() bool {
		sum := 0
		for _, c := range got {
			sum += c
		}
		return sum >= n
	})
	leased := 0
	for i, c := range got {
		if leased >= n {
			break
		}
		require.NotZero(t, c, "claim %d came back empty with %d expired rows left: the loop went idle (claims: %v)", i, n-leased, got)
		leased += c
	}
	for _, m := range msgs {
		require.True(t, seen[m.UUID], "message %s not delivered", m.Payload)
	}
}

// Watermill's DelayOnError keeps scheduling retries once its delay reached
// MaxInterval (the value stops changing, its timestamp does not). Each
// retry is due 300ms after the nack is written, which is after the handler
// started: a lower bound, whatever the load.
func TestDelayOnErrorAtMaxIntervalStillApplies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1} // must not be used
	})
	b.publishInTx(t, "t", true, newMsg("x"))
	var (
		mu       sync.Mutex
		at       []time.Time
		done     = make(chan struct{})
		doneOnce sync.Once
	)
	runRouter(t, sub, "t", func(*message.Message) error {
		mu.Lock()
		at = append(at, time.Now())
		calls := len(at)
		mu.Unlock()
		if calls >= 4 {
			doneOnce.Do(func() { close(done) })
			return nil
		}
		return errors.New("again")
	}, (&middleware.DelayOnError{InitialInterval: 300 * time.Millisecond, MaxInterval: 300 * time.Millisecond, Multiplier: 2}).Middleware)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("not handled four times")
	}
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < 4; i++ {
		require.GreaterOrEqual(t, at[i].Sub(at[i-1]), 290*time.Millisecond, "retry %d came too early", i)
	}
}

// A handler that hangs with a full prefetch buffer behind it: the buffered
// rows are given back after half a lease instead of being renewed for as
// long as the handler hangs, so another consumer gets them. Delivery is at
// least once: every row but the stuck one reaches the other consumer, the
// stuck one does not while it is held.
func TestStuckHandlerGivesBackPrefetchedRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	msgs := newMsgs(n)
	b.publishInTx(t, "t", true, msgs...)
	ev := newEvents()
	stuckSub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = 2 * time.Second
		c.Observer = ev
	})
	ch, err := stuckSub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	acked := map[string]bool{}
	var stuck *message.Message
	for stuck == nil {
		m := receive(t, ch, 10*time.Second)
		if len(acked) < 2000 {
			acked[m.UUID] = true // at least once: a repeat is acked again
			m.Ack()              // fast: the prefetch buffer grows
			continue
		}
		stuck = m // and now the handler hangs
	}
	// A release counted from now: one that happened while the buffer grew
	// (on a slow machine) does not show that the stuck handler's is given
	// back.
	releases := ev.countKind(pgoutbox.EventReleased)
	for ev.countKind(pgoutbox.EventReleased) <= releases {
		ev.wait(t, pgoutbox.EventReleased, 30*time.Second)
	}

	var handled list
	other := b.subscriber(t, nil)
	runRouter(t, other, "t", func(m *message.Message) error { handled.add(m.UUID); return nil })
	pollUntil(t, "every row but the stuck one reaches the other consumer", 60*time.Second, nil,
		func() bool { return b.outboxRows(t, "t") == 1 })
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1`, stuck.UUID),
		"the stuck row stays")
	got := map[string]int{}
	for _, id := range handled.get() {
		got[id]++
	}
	require.Zero(t, got[stuck.UUID], "the stuck row went to the other consumer while held")
	for _, m := range msgs {
		if m.UUID != stuck.UUID && !acked[m.UUID] {
			require.NotZero(t, got[m.UUID], "message %s never reached the other consumer", m.Payload)
		}
	}
	require.LessOrEqual(t, len(handled.get()), 2*(n-2001), "duplicates are bounded")
	stuck.Ack()
}

// With MaxInFlight 1, rows given back while the handler stalled still come
// before newer ones when it resumes, and Close does not report the rows it
// finds given back already as lost leases. Delivery is at least once: a
// message seen before may come again, but a new one is always the next in
// order.
func TestOrderKeptAfterStalledHandlerGivesBackRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	b.publishInTx(t, "t", true, newMsgs(n)...)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = 4 * time.Second
		c.Observer = ev
	})
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	next, repeats := 0, 0
	for next < n {
		m := receive(t, ch, 30*time.Second)
		var i int
		_, err := fmt.Sscan(string(m.Payload), &i)
		require.NoError(t, err)
		switch {
		case i == next:
			next++
		case i < next:
			repeats++ // redelivered: at least once
		default:
			t.Fatalf("message %d out of order: %d expected next", i, next)
		}
		if i == 500 && next == 501 {
			// The handler stalls: the buffer behind it is given back.
			// (Counted from now: a release while the loop ran earlier does
			// not show this one.)
			releases := ev.countKind(pgoutbox.EventReleased)
			for ev.countKind(pgoutbox.EventReleased) <= releases {
				ev.wait(t, pgoutbox.EventReleased, 30*time.Second)
			}
		}
		m.Ack()
	}
	require.LessOrEqual(t, repeats, 100, "duplicates are bounded")
	require.NoError(t, sub.Close())
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
}

// A server that crashes loses its last asynchronous commits, a
// subscriber's acks among them: such a row stays leased to the live
// subscriber, which believes it acked, until its lease ends, and with an
// ordering key it holds the key's next messages back all that while (a
// keyed topic stopped for a whole Lease after a crash). Here the lost ack
// is put back by hand (the row as it was under its lease), and the other
// trace of a crash, the LISTEN connection lost with the liveness lock, by
// pg_terminate_backend: the subscriber writes its recent acks again, and
// the key's next message comes long before the 30 s lease ends.
func TestAnAckTheServerLostIsWrittenAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	app := "reack-" + watermill.NewShortUUID()
	sub := b.subscriberOn(t, b.namedPool(t, app), func(c *pgoutbox.SubscriberConfig) {
		c.Lease, c.MaxPollInterval = 30*time.Second, time.Second
	})
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	first, second := newMsg("first"), newMsg("second")
	pgoutbox.WithOrderingKey(first, "k")
	pgoutbox.WithOrderingKey(second, "k")
	b.publishInTx(t, "t", true, first)
	m := receive(t, msgs, 10*time.Second)
	require.Equal(t, first.UUID, m.UUID)
	b.exec(t, `CREATE TABLE %s.lost AS SELECT * FROM %s.outbox WHERE uuid = $1`, first.UUID)
	m.Ack()
	pollUntil(t, "the ack written", 10*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox`) == 0
	})
	b.exec(t, `INSERT INTO %s.outbox OVERRIDING SYSTEM VALUE SELECT * FROM %s.lost`) // the crash lost the ack
	b.publishInTx(t, "t", true, second)                                              // held back by the row its key still has

	require.Equal(t, 1, b.count(t, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND `+isListenConn, app))
	select {
	case m := <-msgs:
		require.Equal(t, second.UUID, m.UUID)
		m.Ack()
	case <-time.After(15 * time.Second):
		t.Fatal("the key's next message waits for the lease of a row this subscriber acked")
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1`, first.UUID), "the first message is not delivered again")
}
