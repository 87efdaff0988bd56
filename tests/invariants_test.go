package tests

// One test (or more) per delivery invariant (the list in docs/delivery.md,
// "Invariants"). Each would fail if its invariant broke.

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func (b *bundle) names(t *testing.T) query.Names {
	n, err := query.NewNames(b.Schema, "outbox", "outbox_dlq")
	require.NoError(t, err)
	return n
}

func (b *bundle) publishInTx(t *testing.T, topic string, commit bool, msgs ...*message.Message) {
	t.Helper()
	ctx := context.Background()
	pgTx, err := b.Pool.Begin(ctx)
	require.NoError(t, err)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, msgs...))
	if commit {
		require.NoError(t, pgTx.Commit(ctx))
	} else {
		require.NoError(t, pgTx.Rollback(ctx))
	}
}

// Invariant 1: a published message exists iff the caller's transaction
// committed, and so does its wake-up.
func TestInvariant1_MessageExistsIffCommitted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	listener, err := pgx.Connect(ctx, b.DSN)
	require.NoError(t, err)
	defer listener.Close(ctx)
	_, err = listener.Exec(ctx, "LISTEN "+query.Quote(b.names(t).Channel))
	require.NoError(t, err)

	b.publishInTx(t, "rolled-back", false, newMsg("never"))
	b.publishInTx(t, "committed", true, newMsg("yes"))

	// Notifications arrive in commit order: if the rolled-back transaction
	// had notified, its notification would come first.
	waitCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	note, err := listener.WaitForNotification(waitCtx)
	require.NoError(t, err)
	require.Equal(t, "committed", note.Payload)

	require.Equal(t, 0, b.outboxRows(t, "rolled-back"))
	require.Equal(t, 1, b.outboxRows(t, "committed"))

	sub := b.subscriber(t, nil)
	ch, err := sub.Subscribe(ctx, "committed")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "yes", string(m.Payload))
	m.Ack()
}

// Invariant 2: every completion write is guarded by the lease token. A
// subscription whose row was reclaimed by someone else (simulated by
// changing the token) writes nothing and reports lease_lost.
func TestInvariant2_WritesAreGuardedByLeaseToken(t *testing.T) {
	t.Parallel()
	for _, phase := range []string{"ack", "nack", "dead_letter", "renew"} {
		t.Run(phase, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			ev := newEvents()
			sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
				c.Observer = ev
				// "renew": renewal every second. The other phases: a lease
				// long enough that no renewal comes between the takeover
				// and the write under test on a slow machine (one did, and
				// found the token changed first).
				c.Lease = 2 * time.Second
				if phase != "renew" {
					c.Lease = 20 * time.Second
				}
				c.MaxPollInterval = 500 * time.Millisecond
				c.StatementTimeout = 500 * time.Millisecond
			})
			b.publishInTx(t, "t", true, newMsg("x"))
			ch, err := sub.Subscribe(ctx, "t")
			require.NoError(t, err)
			m := receive(t, ch, 10*time.Second)

			// Another consumer takes the row over.
			_, err = b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox
				SET lease_token = gen_random_uuid(), leased_until = now() + interval '1 hour', leased_by = 'other',
				    last_error = 'theirs'`)
			require.NoError(t, err)

			switch phase {
			case "ack":
				m.Ack()
			case "nack":
				m.Nack()
			case "dead_letter":
				_ = pgoutbox.Reject(m, "bad")
				m.Nack()
			case "renew":
				// the renewal ticker finds the token changed
			}
			lost := ev.wait(t, pgoutbox.EventLeaseLost, 10*time.Second)
			require.Equal(t, phase, lost.Phase)

			var leasedBy, lastErr string
			require.NoError(t, b.Pool.QueryRow(ctx, `SELECT leased_by, last_error FROM `+b.Schema+`.outbox`).Scan(&leasedBy, &lastErr))
			require.Equal(t, "other", leasedBy, "the other holder's lease must be untouched")
			require.Equal(t, "theirs", lastErr)
			require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
			if phase == "renew" {
				m.Ack()
			}
		})
	}
}

// Invariant 3: nothing deletes a row that was not acked. Close and context
// cancellation give unacked rows back at once (not after the lease), and
// the next subscriber gets them.
func TestInvariant3_UnackedAtCloseIsRedelivered(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"close", "cancel"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			slow := func(c *pgoutbox.SubscriberConfig) {
				c.Lease = time.Hour // only a release can explain a quick redelivery
				c.MaxPollInterval = 200 * time.Millisecond
				c.DrainTimeout = 200 * time.Millisecond
			}
			b.publishInTx(t, "t", true, newMsg("keep me"))

			first := b.subscriber(t, slow)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ch, err := first.Subscribe(ctx, "t")
			require.NoError(t, err)
			m := receive(t, ch, 10*time.Second)
			if how == "close" {
				require.NoError(t, first.Close())
			} else {
				cancel()
				for range ch { // closes after the drain
				}
			}
			select {
			case <-m.Context().Done():
			default:
				t.Fatal("the unacked message's context must be done once its subscription ended")
			}

			var token *string
			var deliveries int
			require.NoError(t, b.Pool.QueryRow(context.Background(),
				`SELECT lease_token::text, deliveries FROM `+b.Schema+`.outbox`).Scan(&token, &deliveries))
			require.Nil(t, token, "the lease must be released")
			require.Equal(t, 1, deliveries, "the message was handed out once")

			second := b.subscriber(t, slow)
			ch2, err := second.Subscribe(context.Background(), "t")
			require.NoError(t, err)
			m2 := receive(t, ch2, 10*time.Second)
			require.Equal(t, m.UUID, m2.UUID)
			m2.Ack()
			require.NoError(t, second.Close())
			require.Equal(t, 0, b.outboxRows(t, "t"))
		})
	}
}

// Invariant 3, the other half: a late Ack after the drain gave the row back
// must not delete it.
func TestInvariant3_LateAckAfterDrainDeletesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.DrainTimeout = 100 * time.Millisecond
		c.Observer = ev
	})
	b.publishInTx(t, "t", true, newMsg("x"))
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.NoError(t, sub.Close())
	m.Ack()
	require.Equal(t, 1, b.outboxRows(t, "t"))
	require.Equal(t, 1, ev.countKind(pgoutbox.EventReleased))
	require.Equal(t, 0, ev.countKind(pgoutbox.EventAcked))
}

// Invariant 4: the times that gate eligibility come from the database. The
// lease expiry and a relative delay are computed with now() in SQL.
func TestInvariant4_DatabaseClockGatesEligibility(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	delayed := newMsg("later")
	pgoutbox.DeliverAfter(delayed, time.Hour)
	b.publishInTx(t, "t", true, delayed, newMsg("now"))

	var aheadSec float64
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT extract(epoch FROM available_at - created_at) FROM `+b.Schema+`.outbox WHERE uuid = $1`,
		delayed.UUID).Scan(&aheadSec))
	require.InDelta(t, 3600, aheadSec, 0.001, "a delay is now() + interval, in the inserting transaction")

	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Lease = 7 * time.Second })
	ch, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "now", string(m.Payload))
	var leaseSec float64
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT extract(epoch FROM leased_until - now()) FROM `+b.Schema+`.outbox WHERE uuid = $1`,
		m.UUID).Scan(&leaseSec))
	require.InDelta(t, 7, leaseSec, 1.5, "leased_until is now() + Lease on the server")
	m.Ack()
}

// Invariant 5: a row is delivered to one consumer at a time while its lease
// is live. Three subscribers with four handlers each compete for 300
// messages. Every handling is recorded as an interval [start, end) of a
// logical clock, from the moment the handler gets the message until it
// acks, and it lasts (the handler yields and works a little), so two
// consumers holding one row at once would show as overlapping intervals.
// With no failures each message is handled exactly once. It runs on each
// claim path: on the held path, "its lease is live" reads "its held
// transaction is open".
func TestInvariant5_OneConsumerAtATime(t *testing.T) {
	t.Parallel()

	// The detector itself must find an overlap, or the check below could
	// never fail.
	t.Run("DetectorFindsOverlaps", func(t *testing.T) {
		t.Parallel()
		require.NotEmpty(t, overlappingHolds(map[string][]hold{
			"r": {{consumer: 0, start: 1, end: 4}, {consumer: 1, start: 3, end: 6}},
		}), "partly overlapping")
		require.NotEmpty(t, overlappingHolds(map[string][]hold{
			"r": {{consumer: 1, start: 2, end: 3}, {consumer: 0, start: 1, end: 9}},
		}), "one inside the other, listed in reverse order")
		require.NotEmpty(t, overlappingHolds(map[string][]hold{
			"r": {{consumer: 0, start: 1, end: 2}, {consumer: 2, start: 5, end: 9}, {consumer: 1, start: 8, end: 10}},
		}), "the second and the third")
		require.Empty(t, overlappingHolds(map[string][]hold{
			"r": {{consumer: 0, start: 1, end: 2}, {consumer: 1, start: 2, end: 3}},
			"s": {{consumer: 0, start: 1, end: 5}},
			"u": {{consumer: 1, start: 2, end: 4}},
		}), "one after the other, or different rows")
	})

	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			oneConsumerAtATime(t, mode)
		})
	}
}

func oneConsumerAtATime(t *testing.T, mode pgoutbox.ClaimMode) {
	b := setup(t)
	const (
		n         = 300
		consumers = 3
	)
	msgs := newMsgs(n)
	b.publishInTx(t, "t", true, msgs...)

	var (
		clock    atomic.Int64 // logical: every start and end takes a tick
		mu       sync.Mutex
		holds    = map[string][]hold{}
		total    atomic.Int32
		done     = make(chan struct{})
		heldRows atomic.Int64
	)
	for consumer := range consumers {
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.MaxInFlight, c.Lease, c.ClaimMode = 4, time.Minute, mode
			c.Observer = pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
				if e.Kind == pgoutbox.EventClaimed && e.Path == pgoutbox.PathHeld {
					heldRows.Add(int64(e.Count))
				}
			})
		})
		ch, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		go func() {
			for m := range ch {
				go func(m *message.Message) {
					start := clock.Add(1)
					// The handler's work: the row stays held across
					// yields, so a second holder would have time to show.
					for range 3 {
						runtime.Gosched()
						time.Sleep(time.Millisecond)
					}
					end := clock.Add(1)
					mu.Lock()
					holds[m.UUID] = append(holds[m.UUID], hold{consumer: consumer, start: start, end: end})
					mu.Unlock()
					m.Ack()
					if total.Add(1) == n {
						close(done)
					}
				}(m)
			}
		}()
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("only %d of %d handled", total.Load(), n)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, overlappingHolds(holds), "a row was held by two handlers at once")
	if mode == pgoutbox.ClaimHeld {
		require.Positive(t, heldRows.Load(), "no row was claimed on the held path")
	}
	require.Len(t, holds, n)
	for id, hs := range holds {
		require.Len(t, hs, 1, "message %s", id)
		require.Greater(t, hs[0].end, hs[0].start)
	}
}

// hold is one handling of a row by a consumer: [start, end) on a logical
// clock.
type hold struct {
	consumer   int
	start, end int64
}

// overlappingHolds describes every pair of holds of one row that overlap
// in time: each began before the other ended.
func overlappingHolds(byRow map[string][]hold) []string {
	var out []string
	for row, hs := range byRow {
		for i := range hs {
			for j := i + 1; j < len(hs); j++ {
				a, b := hs[i], hs[j]
				if a.start < b.end && b.start < a.end {
					out = append(out, fmt.Sprintf("row %s: consumer %d held it during [%d, %d), consumer %d during [%d, %d)",
						row, a.consumer, a.start, a.end, b.consumer, b.start, b.end))
				}
			}
		}
	}
	return out
}

// Invariant 5, with a live lease held by another process: the row is not
// delivered, while an expired lease is reclaimed.
func TestInvariant5_LiveLeaseIsNotReclaimedExpiredIs(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	live, expired := newMsg("live"), newMsg("expired")
	b.publishInTx(t, "t", true, live, expired)
	_, err := b.Pool.Exec(ctx, `UPDATE `+b.Schema+`.outbox
		SET lease_token = gen_random_uuid(), leased_by = 'crashed', deliveries = 1,
		    leased_until = now() + CASE WHEN uuid = $1 THEN interval '1 hour' ELSE -interval '1 second' END`, live.UUID)
	require.NoError(t, err)

	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev })
	ch, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, expired.UUID, m.UUID)
	m.Ack()
	ev.wait(t, pgoutbox.EventAcked, 10*time.Second)
	// The loop claims again after the ack and finds nothing claimable.
	for {
		e := ev.wait(t, pgoutbox.EventClaimed, 10*time.Second)
		if e.Count == 0 {
			break
		}
		t.Fatalf("claimed %d more rows; the live lease must not be reclaimed", e.Count)
	}
	var deliveries int
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT deliveries FROM `+b.Schema+`.outbox WHERE uuid = $1`, live.UUID).Scan(&deliveries))
	require.Equal(t, 1, deliveries)
}
