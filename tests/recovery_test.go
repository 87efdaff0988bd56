package tests

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Rows a crashed consumer held come back at claim speed once their leases
// expired, not one poll interval at a time: the idle loop wakes for an
// expired lease and the claim that follows looks for them.
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
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MinPollInterval, c.MaxPollInterval, c.Lease = time.Second, 5*time.Second, 30*time.Second
	})
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	for range n {
		receive(t, ch, 20*time.Second).Ack()
	}
}

// Watermill's DelayOnError keeps scheduling retries once its delay reached
// MaxInterval (the value stops changing, its timestamp does not).
func TestDelayOnErrorAtMaxIntervalStillApplies(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1} // must not be used
	})
	b.publishInTx(t, "t", true, newMsg("x"))
	var at []time.Time
	done := make(chan struct{})
	runRouter(t, sub, "t", func(*message.Message) error {
		at = append(at, time.Now())
		if len(at) == 4 {
			close(done)
			return nil
		}
		return errors.New("again")
	}, (&middleware.DelayOnError{InitialInterval: 300 * time.Millisecond, MaxInterval: 300 * time.Millisecond, Multiplier: 2}).Middleware)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("not handled four times")
	}
	for i := 1; i < len(at); i++ {
		require.GreaterOrEqual(t, at[i].Sub(at[i-1]), 290*time.Millisecond, "retry %d came too early", i)
	}
}

// A handler that hangs with a full prefetch buffer behind it: the buffered
// rows are given back after half a lease instead of being renewed for as
// long as the handler hangs, so another consumer gets them.
func TestStuckHandlerGivesBackPrefetchedRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	msgs := newMsgs(n)
	b.publishInTx(t, "t", true, msgs...)
	ev := newEvents()
	stuckSub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease, c.StatementTimeout = 2*time.Second, 500*time.Millisecond
		c.Observer = ev
	})
	ch, err := stuckSub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	var stuck *message.Message
	for i := 0; stuck == nil; i++ {
		m := receive(t, ch, 10*time.Second)
		if i < 2000 {
			m.Ack() // fast: the prefetch buffer grows
			continue
		}
		stuck = m // and now the handler hangs
	}
	ev.wait(t, pgoutbox.EventReleased, 10*time.Second)

	var got atomic.Int32
	other := b.subscriber(t, nil)
	runRouter(t, other, "t", func(*message.Message) error { got.Add(1); return nil })
	require.Eventually(t, func() bool { return b.outboxRows(t, "t") == 1 }, 20*time.Second, 10*time.Millisecond,
		"every row but the stuck one reaches the other consumer")
	require.Equal(t, int32(n-2001), got.Load())
	stuck.Ack()
}

// With MaxInFlight 1, rows given back while the handler stalled still come
// before newer ones when it resumes, and Close does not report the rows it
// finds given back already as lost leases.
func TestOrderKeptAfterStalledHandlerGivesBackRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 3000
	b.publishInTx(t, "t", true, newMsgs(n)...)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease, c.StatementTimeout = 2*time.Second, 500*time.Millisecond
		c.Observer = ev
	})
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	for i := range n {
		m := receive(t, ch, 20*time.Second)
		require.Equal(t, fmt.Sprint(i), string(m.Payload), "message %d out of order", i)
		if i == 500 {
			// The handler stalls: the buffer behind it is given back.
			ev.wait(t, pgoutbox.EventReleased, 10*time.Second)
		}
		m.Ack()
	}
	require.NoError(t, sub.Close())
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
}
