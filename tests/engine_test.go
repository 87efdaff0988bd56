package tests

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Regression tests for the subscription engine (one owner goroutine per
// subscription). Each names the defect of the earlier design it pins.

// waitCount waits until n() reaches want, failing after within.
func waitCount(t *testing.T, what string, want int, within time.Duration, n func() int) {
	t.Helper()
	pollUntil(t, fmt.Sprintf("%s: want %d", what, want), within, nil, func() bool { return n() >= want })
}

// orderedSeq returns payloads "0".."n-1" with the payload at nack inserted
// again right after itself: the order an ordered subscription must keep
// when that message is nacked once.
func orderedSeq(n, nack int) []string {
	var out []string
	for i := range n {
		out = append(out, strconv.Itoa(i))
		if i == nack {
			out = append(out, strconv.Itoa(i))
		}
	}
	return out
}

// Defect 4: with MaxInFlight 1 a nacked message came back behind the whole
// backlog (3,000 rows, message 100 nacked once with delay 0: redelivered at
// position 3,000). Now it is delivered again before any later message, with
// or without a retry delay (the subscription waits for it).
func TestOrderedNackIsRedeliveredBeforeLaterMessages(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		n, nack int
		delay   time.Duration
	}{
		"NoDelay":   {n: 3000, nack: 100},
		"WithDelay": {n: 600, nack: 50, delay: 300 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ev := newEvents()
			sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
				c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: tc.delay, MaxAttempts: -1}
				c.Observer = ev
			})
			b.publishInTx(t, "t", true, newMsgs(tc.n)...)
			seen := &list{}
			var nacked atomic.Bool
			runRouter(t, sub, "t", func(m *message.Message) error {
				seen.add(string(m.Payload))
				if string(m.Payload) == strconv.Itoa(tc.nack) && nacked.CompareAndSwap(false, true) {
					return errors.New("once")
				}
				return nil
			})
			waitCount(t, "handled", tc.n+1, 30*time.Second, func() int { return len(seen.get()) })
			require.Equal(t, orderedSeq(tc.n, tc.nack), seen.get())
			require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
			pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
		})
	}
}

// The hold an ordered retry writes counts the delivery and keeps the error:
// a message nacked twice is delivered three times, with deliveries 3 and
// its last error stored meanwhile, and MaxDeliveries still applies.
func TestOrderedRetryCountsDeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1}
		c.MaxDeliveries = 3
		c.Observer = ev
	})
	msg := newMsg("x")
	b.publishInTx(t, "t", true, msg, newMsg("after"))
	seen := &list{}
	runRouter(t, sub, "t", func(m *message.Message) error {
		seen.add(string(m.Payload))
		if string(m.Payload) == "x" {
			return fmt.Errorf("attempt %d", len(seen.get()))
		}
		return nil
	}, pgoutbox.ErrorRecorder)
	dead := ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	require.Equal(t, pgoutbox.ReasonMaxDeliveries, dead.Reason)
	row := b.dlq(t, msg.UUID)
	require.Equal(t, 4, row.deliveries, "three deliveries, the fourth refused")
	require.Equal(t, "attempt 3", row.lastError)
	waitCount(t, "handled", 4, 10*time.Second, func() int { return len(seen.get()) })
	require.Equal(t, []string{"x", "x", "x", "after"}, seen.get())
}

// Defect 3: a give-back raced by a claim released rows twice, and each
// second release was reported as lease_lost (with a slow Observer, 200
// spurious events for one claim). A stalled handler makes the buffer go
// back while claims run, with an Observer slow on every event: no
// lease_lost, every message once, in order.
func TestGiveBackRacingClaimsReleasesEachRowOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	slow := pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
		if e.Kind == pgoutbox.EventReleased || e.Kind == pgoutbox.EventLeaseRenewed {
			time.Sleep(20 * time.Millisecond)
		}
		ev.Observe(e)
	})
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = 2 * time.Second // buffered rows go back after 1s
		c.Observer = slow
	})
	const n = 2000
	b.publishInTx(t, "t", true, newMsgs(n)...)
	seen := &list{}
	stall := make(chan struct{})
	runRouter(t, sub, "t", func(m *message.Message) error {
		if seen.add(string(m.Payload)) == 300 {
			<-stall // long enough for the buffer to go back
		}
		return nil
	})
	ev.wait(t, pgoutbox.EventReleased, 20*time.Second)
	close(stall)
	waitCount(t, "handled", n, 60*time.Second, func() int { return len(seen.get()) })
	require.Equal(t, orderedSeq(n, -1), seen.get())
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost), "every release applies exactly once")
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
}

// Defect 2: the renewal held the completer's lock and took the fetch
// loop's, while a claim did the opposite, so Close could hang forever. The
// owner design has no such locks; this drives renewals, give-backs, claims
// and acks at once (short lease, stalling handlers, MaxInFlight 4) and
// requires Close to return, repeatedly.
func TestCloseReturnsWhileRenewalsGiveBacksAndClaimsRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for round := range 5 {
		ev := newEvents()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Lease = time.Second
			c.MaxPollInterval = 200 * time.Millisecond
			c.StatementTimeout = 300 * time.Millisecond
			c.MaxInFlight = 4
			c.DrainTimeout = 300 * time.Millisecond
			c.Observer = ev
		})
		topic := fmt.Sprintf("t%d", round)
		b.publishInTx(t, topic, true, newMsgs(1000)...)
		msgs, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		go func() {
			i := 0
			for m := range msgs {
				if i++; i%100 == 0 {
					time.Sleep(600 * time.Millisecond) // stall: renewals and a give-back happen meanwhile
				}
				m.Ack()
			}
		}()
		ev.wait(t, pgoutbox.EventLeaseRenewed, 10*time.Second)
		requireClosed(t, fmt.Sprintf("round %d: Close", round), sub.Close)
		require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost))
	}
}

// Defect 5: a hung handler held its row forever (renewal was
// unconditional) and, with MaxInFlight 1, stopped its subscription. Past
// AckDeadline the message's context is cancelled, the row is nacked with a
// recorded error and delivered again, and the subscription goes on.
func TestAckDeadlineEndsAHungHandler(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.AckDeadline = 300 * time.Millisecond
		c.Observer = ev
	})
	hung, next := newMsg("hung"), newMsg("next")
	b.publishInTx(t, "t", true, hung, next)
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)

	first := receive(t, msgs, 10*time.Second)
	require.Equal(t, hung.UUID, first.UUID)
	select {
	case <-first.Context().Done(): // the handler is told to give up
	case <-time.After(10 * time.Second):
		t.Fatal("the hung message's context was not cancelled")
	}
	// Ordered: the same message comes again before the next one.
	again := receive(t, msgs, 10*time.Second)
	require.Equal(t, hung.UUID, again.UUID)
	var lastErr string
	var deliveries int
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT last_error, deliveries FROM `+b.Schema+`.outbox WHERE uuid = $1`,
		hung.UUID).Scan(&lastErr, &deliveries))
	require.Contains(t, lastErr, "ack deadline exceeded")
	require.Equal(t, 2, deliveries)
	require.True(t, first.Ack(), "a late Ack is accepted by the message ...")
	again.Ack()
	require.Equal(t, next.UUID, receive(t, msgs, 10*time.Second).UUID)
	require.GreaterOrEqual(t, ev.countKind(pgoutbox.EventRetried), 1)
	require.Zero(t, ev.countKind(pgoutbox.EventLeaseLost), "... and ignored: it writes nothing")
}

// With MaxInFlight > 1 the slot that waits for a message keeps its
// deadline: a hung handler's message is nacked and delivered again while the
// others flow.
func TestAckDeadlineWithManyInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MaxInFlight = 4
		c.AckDeadline = 300 * time.Millisecond
		c.Observer = ev
	})
	hung := newMsg("hung")
	b.publishInTx(t, "t", true, append([]*message.Message{hung}, newMsgs(20)...)...)
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	// The others go on beside the hung one; on a loaded machine its
	// deadline may pass before they are all taken, and it comes back
	// among them.
	var first, again *message.Message
	others := 0
	for first == nil || again == nil || others < 20 {
		if first != nil && again == nil && others == 20 {
			select {
			case <-first.Context().Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the hung message's context was not cancelled")
			}
		}
		m := receive(t, msgs, 10*time.Second)
		switch {
		case m.UUID != hung.UUID:
			others++
			m.Ack()
		case first == nil:
			first = m // never answered
		case again == nil:
			select {
			case <-first.Context().Done():
			default:
				t.Fatal("the hung message came back while its first delivery was live")
			}
			again = m
			again.Ack()
		default:
			t.Fatal("the hung message came a third time")
		}
	}
	ev.wait(t, pgoutbox.EventRetried, 10*time.Second)
	pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
}

// A batch whose handlers all hang (a relay's call to a broker that does
// not answer) passes its deadlines together: a few error lines a window
// and the others at debug, not one error each; every message is nacked and
// delivered again.
func TestAckDeadlinesOfAStalledBatchLogAFewErrors(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		logs := &logCapture{}
		b.logger = logs
		const n = 16
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = n
			c.AckDeadline = 300 * time.Millisecond
		})
		b.publishInTx(t, "t", true, newMsgs(n)...)
		msgs, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		deliveries := map[string]int{}
		for again := 0; again < n; {
			m := receive(t, msgs, 10*time.Second)
			if deliveries[m.UUID]++; deliveries[m.UUID] >= 2 {
				m.Ack() // the first delivery hung (a late ack's deadline may pass too: acked again)
				if deliveries[m.UUID] == 2 {
					again++
				}
			}
		}
		pollUntil(t, "outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
		deadline := func(e logEntry) bool { return e.fields["event"] == "ack_deadline" }
		errLines, debugLines := logs.find("error", deadline), logs.find("debug", deadline)
		require.Len(t, errLines, logbudget.PerWindow, "one window's budget, of the %d deadlines", n)
		require.GreaterOrEqual(t, len(errLines)+len(debugLines), n, "every passed deadline is logged, the most at debug")
	})
}

// An ordered subscription's own retry is counted when it goes out, not at
// the nack: while it waits out its delay the row holds the one delivery
// that ran (counted at the nack, a crash during the wait left a delivery
// counted that never ran: TestFaultACrashDuringAnOrderedRetryWaitCountsNoDelivery),
// and the retry goes out as attempt 2, counted, on every claim path.
func TestOrderedRetryIsCountedWhenItGoesOut(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ev := newEvents()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 1
			c.Observer = ev
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Second, MaxAttempts: pgoutbox.RetryForever}
		})
		msgs, err := sub.Subscribe(context.Background(), "t")
		require.NoError(t, err)
		require.NoError(t, b.poolPublisher(t).Publish("t", newMsg("a"), newMsg("b")))
		m := receive(t, msgs, 10*time.Second)
		first, _ := pgoutbox.DeliveryOf(m)
		if path != "auto" {
			require.Equal(t, path, first.Path)
		}
		m.Nack()
		ev.wait(t, pgoutbox.EventRetried, 10*time.Second) // the nack's hold is written
		deliveries := `SELECT deliveries FROM ` + b.Schema + `.outbox WHERE payload = 'a'`
		require.Equal(t, 1, b.count(t, deliveries), "the retry is counted before it runs")
		again := receive(t, msgs, 10*time.Second)
		require.Equal(t, m.UUID, again.UUID, "the retry goes out before what follows")
		d, _ := pgoutbox.DeliveryOf(again)
		require.Equal(t, 2, d.Attempt)
		require.Equal(t, 2, b.count(t, deliveries), "the retry is counted as it goes out")
		again.Ack()
		receive(t, msgs, 10*time.Second).Ack()
	})
}

// A row lost while its handler runs (an operator deleted it, or the held
// batch it came in rolled back) is no longer the subscription's, but what
// comes after it still waits for that handler: the next message of an
// ordered subscription, the row claimed again. AckDeadline bounds that wait
// as it bounds a row still ours; with MaxInFlight 1 a handler that never
// returned held the subscription for good.
func TestAckDeadlineBoundsTheWaitForALostRowsHandler(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 2} {
		for _, loss := range []string{"deleted", "held batch killed"} {
			t.Run(fmt.Sprintf("MaxInFlight %d, %s", inFlight, loss), func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				ctx := context.Background()
				pool, app := heldPool(t, b, 10)
				ev := newEvents()
				id := "lost-hung-" + watermill.NewShortUUID()
				path := testhook.PathLease
				if loss == "held batch killed" {
					path = testhook.PathHeld
					testhook.SetHeldBound(id, time.Minute)
					t.Cleanup(func() { testhook.SetHeldBound(id, 0) })
				}
				sub := b.subscriberOn(t, pool, func(c *pgoutbox.SubscriberConfig) {
					c.WorkerID = id
					onPath(t, path, c)
					c.MaxInFlight = inFlight
					c.Lease = 2 * time.Second
					c.MaxPollInterval = 500 * time.Millisecond
					c.AckDeadline = 4 * time.Second
					c.DrainTimeout = -1
					c.Observer = ev
				})
				hung, next := newMsg("hung"), newMsg("next")
				pgoutbox.WithOrderingKey(hung, "k")
				pgoutbox.WithOrderingKey(next, "k")
				b.publishInTx(t, "t", true, hung)
				msgs, err := sub.Subscribe(ctx, "t")
				require.NoError(t, err)
				first := receive(t, msgs, 10*time.Second)
				require.Equal(t, hung.UUID, first.UUID)
				if loss == "deleted" {
					_, err = b.Pool.Exec(ctx, `DELETE FROM `+b.Schema+`.outbox WHERE uuid = $1`, hung.UUID)
					require.NoError(t, err)
					ev.wait(t, pgoutbox.EventLeaseLost, 10*time.Second)
				} else {
					var killed int
					require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 2000))
						FROM pg_stat_activity WHERE `+idleInTxOf, app).Scan(&killed))
					require.Equal(t, 1, killed, "the held batch's transaction")
				}
				select {
				case <-first.Context().Done(): // the handler is told to stop, and does not
				case <-time.After(10 * time.Second):
					t.Fatal("the lost row's message context was not cancelled")
				}
				b.publishInTx(t, "t", true, next)
				want := []string{next.UUID}
				if loss == "held batch killed" {
					want = []string{hung.UUID, next.UUID} // rolled back: due again, first
				}
				for _, uuid := range want {
					m := receive(t, msgs, 20*time.Second)
					require.Equal(t, uuid, m.UUID)
					m.Ack()
				}
				first.Ack() // the hung handler returns at last
				pollUntil(t, "the outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
			})
		}
	}
}

// AckDeadline -1 turns the deadline off: a handler may run past the
// default 30s equivalent; its lease is renewed while it does.
func TestAckDeadlineCanBeTurnedOff(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = time.Second
		c.MaxPollInterval = 200 * time.Millisecond
		c.StatementTimeout = 300 * time.Millisecond
		c.AckDeadline = -1
		c.Observer = ev
	})
	b.publishInTx(t, "t", true, newMsg("slow"))
	msgs, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	for range 3 { // three renewals: past three lease periods' halves
		ev.wait(t, pgoutbox.EventLeaseRenewed, 10*time.Second)
	}
	require.NoError(t, m.Context().Err())
	m.Ack()
	ev.wait(t, pgoutbox.EventAcked, 10*time.Second)
	require.Zero(t, ev.countKind(pgoutbox.EventRetried))
}

// Defect 6: rows released at Close reached an idle competitor only at its
// next poll (3.1-3.7s measured). The release now sends a NOTIFY: the
// competitor, polling only every 30s, gets the row at once.
func TestReleasedRowsWakeAnIdleCompetitor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.DrainTimeout = -1 })
	aMsgs, err := a.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	msg := newMsg("x")
	b.publishInTx(t, "t", true, msg)
	require.Equal(t, msg.UUID, receive(t, aMsgs, 10*time.Second).UUID) // held, never acked

	ev := newEvents()
	competitor := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.Lease = time.Minute
		c.MinPollInterval, c.MaxPollInterval = 30*time.Second, 30*time.Second
		c.Observer = ev
	})
	cMsgs, err := competitor.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	require.Zero(t, ev.wait(t, pgoutbox.EventClaimed, 10*time.Second).Count, "the row is A's: the competitor goes idle")

	require.NoError(t, a.Close())
	got := receive(t, cMsgs, 5*time.Second) // far below the 30s poll
	require.Equal(t, msg.UUID, got.UUID)
	got.Ack()
}

// Defect 7: "_watermill_delayed_for" survived delivery, so a handler that
// copied the metadata into its output delayed that output again, on every
// hop. Delay keys are now left out of delivered messages.
func TestDelayMetadataIsNotHandedOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	in := newMsg("in")
	delay.Message(in, delay.For(200*time.Millisecond))
	require.NoError(t, pub.Publish("in", in))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	seen := make(chan message.Metadata, 1)
	r.AddHandler("copy", "in", b.subscriber(t, nil), "out", pub, func(m *message.Message) ([]*message.Message, error) {
		seen <- maps.Clone(m.Metadata)
		out := message.NewMessage(watermill.NewUUID(), m.Payload)
		out.Metadata = maps.Clone(m.Metadata)
		return []*message.Message{out}, nil
	})
	startRouter(t, r)
	var md message.Metadata
	select {
	case md = <-seen:
	case <-time.After(10 * time.Second):
		t.Fatal("not delivered")
	}
	require.NotContains(t, md, delay.DelayedForKey)
	require.NotContains(t, md, delay.DelayedUntilKey)
	pollUntil(t, "output written", 10*time.Second, nil, func() bool { return b.outboxRows(t, "out") == 1 })
	var notDelayed bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at = created_at FROM `+b.Schema+`.outbox WHERE topic = 'out'`).Scan(&notDelayed))
	require.True(t, notDelayed, "the output must not be delayed again")
}

// A redelivery that DelayOnError delayed carries "delayed for" alone (its
// multiplier grows the next delay from it). A handler or relay that copies
// that metadata into its output must not delay the output: the publisher
// delays a message only when "delayed until" is set too, as Watermill's
// delay.Message, delay.NewPublisher and DelayOnError always do.
func TestACopyOfARedeliveryThatDelayOnErrorDelayedIsNotDelayed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	b.publishInTx(t, "in", true, newMsg("in"))

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var tries atomic.Int32
	forwarded := make(chan message.Metadata, 1)
	r.AddHandler("forward", "in", b.subscriber(t, nil), "out", pub, func(m *message.Message) ([]*message.Message, error) {
		if tries.Add(1) == 1 {
			return nil, errors.New("not yet")
		}
		forwarded <- maps.Clone(m.Metadata)
		return []*message.Message{m.Copy()}, nil
	})
	r.AddMiddleware((&middleware.DelayOnError{InitialInterval: 100 * time.Millisecond, MaxInterval: time.Second, Multiplier: 2}).Middleware)
	startRouter(t, r)
	select {
	case md := <-forwarded:
		require.Equal(t, "100ms", md.Get(delay.DelayedForKey), "the redelivery carries its delay for DelayOnError's multiplier")
		require.NotContains(t, md, delay.DelayedUntilKey)
	case <-time.After(20 * time.Second):
		t.Fatal("not redelivered")
	}
	pollUntil(t, "output written", 10*time.Second, nil, func() bool { return b.outboxRows(t, "out") == 1 })
	var notDelayed bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at = created_at FROM `+b.Schema+`.outbox WHERE topic = 'out'`).Scan(&notDelayed))
	require.True(t, notDelayed, "the copy must not be delayed by the retry's delay")

	// Watermill's own ways to delay set both keys, and still delay.
	both := newMsg("both")
	delay.Message(both, delay.For(time.Hour))
	require.NoError(t, pub.Publish("both", both))
	var delayed bool
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at > created_at + interval '59 minutes' FROM `+b.Schema+`.outbox WHERE topic = 'both'`).Scan(&delayed))
	require.True(t, delayed)
}

// Defect 7: JSON null metadata decoded as empty metadata; it is not an
// object, so the row is poisoned (dead-lettered), and the topic goes on.
func TestNullMetadataIsPoisoned(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	_, err := b.Pool.Exec(context.Background(), `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, metadata) VALUES ('t', 'null-md', '\x00', 'null')`)
	require.NoError(t, err)
	b.publishInTx(t, "t", true, newMsg("fine"))
	msgs, err := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev }).Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	require.Equal(t, "fine", string(m.Payload))
	m.Ack()
	dead := ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	require.Equal(t, pgoutbox.ReasonPoisoned, dead.Reason)
	require.Contains(t, b.dlq(t, "null-md").lastError, "null")
}

// Defect 8: a pool publisher used the incoming message's context, so
// PoisonQueue under middleware.Timeout failed with "context deadline
// exceeded" and the message looped through retries instead of reaching the
// poison topic. A pool Publish now keeps the context's values, not its
// cancellation.
func TestPoisonQueueUnderTimeoutReachesThePoisonTopic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := b.poolPublisher(t)
	poison, err := middleware.PoisonQueue(pub, "poison")
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(poison, middleware.Timeout(50*time.Millisecond))
	var attempts atomic.Int32
	r.AddConsumerHandler("slow", "t", b.subscriber(t, nil), func(m *message.Message) error {
		attempts.Add(1)
		<-m.Context().Done()
		return m.Context().Err()
	})
	startRouter(t, r)
	msg := newMsg("x")
	b.publishInTx(t, "t", true, msg)
	pollUntil(t, "the message reaches the poison topic", 10*time.Second, nil, func() bool {
		return b.outboxRows(t, "poison") == 1
	})
	pollUntil(t, "the original is acked", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
	require.Equal(t, int32(1), attempts.Load())
}

// Config errors name only values the user set: Lease -1s used to report
// "StatementTimeout is -501ms", a value derived from it.
func TestConfigErrorsNameOnlySetValues(t *testing.T) {
	t.Parallel()
	err := pgoutbox.SubscriberConfig{Lease: -time.Second}.Validate()
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "Lease is -1s")
	for _, derived := range []string{"StatementTimeout", "MaxPollInterval", "MinPollInterval"} {
		require.NotContains(t, err.Error(), derived)
	}
	// A WorkerID PostgreSQL text cannot hold made every claim fail.
	err = pgoutbox.SubscriberConfig{WorkerID: "host\x00:1"}.Validate()
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "WorkerID")
	_, err = pgoutbox.NewSubscriber(setup(t).Pool, pgoutbox.SubscriberConfig{WorkerID: strings.Repeat("w", 300)}, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
}

// A live process whose LISTEN connection (and so its liveness lock) drops
// and comes back must not lose its rows to a competitor: a key counts as
// dead only once it stayed gone for a second (notifier.OrphanGrace). A holds a message with a
// long lease while its LISTEN backend is terminated over and over; B, on
// another pool (another notifier), is woken each time its notifier sees the
// lock missing, and must never receive the message.
func TestLivenessBlipsDoNotOrphanALiveHolder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	appA := "blip-a-" + watermill.NewShortUUID()
	poolA := b.namedPool(t, appA)
	newSub := func(pool *pgxpool.Pool) *pgoutbox.Subscriber {
		s, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
			Tables: b.tables, Lease: time.Minute, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 200 * time.Millisecond,
			DrainTimeout: -1, // A never acks: do not wait for it at Close
		}, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	a := newSub(poolA)
	aMsgs, err := a.Subscribe(ctx, "t")
	require.NoError(t, err)
	held := newMsg("held")
	b.publishInTx(t, "t", true, held)
	require.Equal(t, held.UUID, receive(t, aMsgs, 10*time.Second).UUID) // never acked

	bMsgs, err := newSub(b.Pool).Subscribe(ctx, "t")
	require.NoError(t, err)
	for range 5 {
		// A's notifier (re)connects in the background: wait for it.
		pollUntil(t, "A's LISTEN connection is up", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND `+isListenConn, appA) == 1
		})
		var n int
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid, 2000)) FROM pg_stat_activity
			WHERE application_name = $1 AND `+isListenConn, appA).Scan(&n))
		require.Equal(t, 1, n, "A's LISTEN connection is terminated")
		requireNothing(t, bMsgs, 1100*time.Millisecond) // two liveness checks of B's notifier
	}
	// Still A's: its lease was never taken over.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1 AND lease_token IS NOT NULL AND deliveries = 1`, held.UUID))
}

// A Router whose context is cancelled ends its subscriptions without
// closing its subscriber (Watermill's Router does not): the subscriber's
// LISTEN connection, opened outside the pool, goes with its last
// subscription, so a pool closed after the channels closed leaves nothing
// on the server. A later Subscribe listens again.
func TestListenConnectionEndsWithTheLastSubscription(t *testing.T) {
	t.Parallel()
	b := setup(t)
	app := "listen-end-" + watermill.NewShortUUID()
	pool := b.namedPool(t, app)
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	listening := func() int {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND `+isListenConn, app)
	}

	ctxA, cancelA := context.WithCancel(context.Background())
	ctxB, cancelB := context.WithCancel(context.Background())
	chA, err := sub.Subscribe(ctxA, "a")
	require.NoError(t, err)
	chB, err := sub.Subscribe(ctxB, "b")
	require.NoError(t, err)
	pollUntil(t, "the LISTEN connection is up", 10*time.Second, nil, func() bool { return listening() == 1 })

	cancelA()
	for range chA {
	}
	b.publishInTx(t, "b", true, newMsg("still woken"))
	receive(t, chB, 10*time.Second).Ack()
	require.Equal(t, 1, listening(), "one subscription still runs: its connection stays")

	cancelB()
	for range chB {
	}
	// The connection is closed when the channel closes; its backend exits
	// just after.
	pollUntil(t, "the last subscription ended: no LISTEN connection is left", 5*time.Second, nil, func() bool { return listening() == 0 })

	ch, err := sub.Subscribe(context.Background(), "c")
	require.NoError(t, err)
	pollUntil(t, "the LISTEN connection is up again", 10*time.Second, nil, func() bool { return listening() == 1 })
	b.publishInTx(t, "c", true, newMsg("woken again"))
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "woken again", string(m.Payload))
	m.Ack()
	require.NoError(t, sub.Close())
	pollUntil(t, "Close: no LISTEN connection is left", 5*time.Second, nil, func() bool { return listening() == 0 })
}

// An ordered subscription whose message in flight is nacked during a
// graceful stop: nobody retries it in this process, and a retry delay
// (here none: it would come due at the stop) used to put it behind every
// later message. It keeps its place, as the rows the stop gives back do:
// the next subscriber delivers it first, on every claim path and layout.
func TestOrderedNackDuringTheDrainKeepsItsPlace(t *testing.T) {
	for _, layout := range []string{"outbox", "arrivals"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				b := layoutBundle(t, layout)
				b.publishInTx(t, "t", true, newMsgs(5)...)
				ordered := func() *pgoutbox.Subscriber {
					return b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
						onPath(t, path, c)
						c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Millisecond, MaxAttempts: -1}
					})
				}
				sub := ordered()
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
				require.NoError(t, err)
				started, closing := make(chan struct{}), make(chan struct{})
				r.AddConsumerHandler("h", "t", sub, func(m *message.Message) error {
					close(started) // the first message only: the router closes while it runs
					<-closing
					// Nothing tells a handler that its subscription began to
					// stop: give the stop time to get there. (Had the nack
					// come first, the row is an ordered retry that the stop
					// gives back: its place holds too.)
					time.Sleep(200 * time.Millisecond)
					return errors.New("failed while the subscriber stops")
				})
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-started
				close(closing)
				require.NoError(t, r.Close())
				require.NoError(t, <-done)
				requireClosed(t, "Close", sub.Close)

				seen := &list{}
				runRouter(t, ordered(), "t", func(m *message.Message) error {
					seen.add(string(m.Payload))
					return nil
				})
				waitCount(t, "handled", 5, 30*time.Second, func() int { return len(seen.get()) })
				require.Equal(t, []string{"0", "1", "2", "3", "4"}, seen.get(), "publish order after a nack during the drain")
			})
		})
	}
}

// A slot stops offering a message once its row's lease may have passed (a
// process frozen past it), but a message a slow consumer takes late on a
// healthy process keeps its lease, renewed all along, and is not given
// back: its offer ran to a statement's time before its lease's end, which
// renewals (every Lease/2) did not always move on in time, and the row went
// back and forth between release and claim.
func TestAMessageASlowConsumerTakesLateIsNotGivenBack(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		ev := newEvents()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 2
			c.Lease = 2 * time.Second // StatementTimeout: Lease/2 less a millisecond
			c.AckDeadline = pgoutbox.NoAckDeadline
			c.Observer = ev
		})
		b.publishInTx(t, "t", true, newMsg("a"), newMsg("b"))
		msgs, err := sub.Subscribe(ctx, "t")
		require.NoError(t, err)
		first := receive(t, msgs, 10*time.Second)
		time.Sleep(3 * time.Second) // the consumer works on the first: the second waits in its slot, past the first lease
		second := receive(t, msgs, 10*time.Second)
		first.Ack()
		second.Ack()
		pollUntil(t, "the outbox empty", 10*time.Second, nil, func() bool { return b.outboxRows(t, "t") == 0 })
		require.Zero(t, ev.countKind(pgoutbox.EventReleased), "a message waiting for a healthy consumer was given back")
	})
}

// A subscription whose handlers turn slow gives its prefetched rows back
// once the rate they answer at would not get through them within a second,
// not after half a lease: a competitor of the group takes them meanwhile.
// (Handlers that went from 1 ms to 2 s kept a few hundred rows for 15 s,
// half the default lease, while the other consumer had nothing to do.)
// A's handlers run fast, then stop; B starts once A stopped and must get
// every message but A's in flight well before half a lease.
func TestAConsumerWhoseHandlersTurnSlowGivesItsBufferToACompetitor(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const (
				topic    = "t"
				n        = 6000
				inFlight = 16
			)
			b.publishInTx(t, topic, true, newMsgs(n)...)
			cfg := func(ev pgoutbox.Observer) func(*pgoutbox.SubscriberConfig) {
				return func(c *pgoutbox.SubscriberConfig) {
					c.Lease = 30 * time.Second // the default: half of it is 15 s
					c.MaxInFlight = inFlight
					c.ClaimMode = mode
					c.Observer = ev
				}
			}
			evA := newEvents()
			a := b.subscriber(t, cfg(evA))
			var handledA atomic.Int64
			stuck := make(chan struct{})
			stop := make(chan struct{})
			runRouter(t, a, topic, func(m *message.Message) error {
				if handledA.Add(1) > 1500 {
					select {
					case stuck <- struct{}{}:
					default:
					}
					<-stop // the handlers turn slow: they stop answering
					return nil
				}
				time.Sleep(time.Millisecond)
				return nil
			})
			t.Cleanup(func() { close(stop) }) // before the Router's Close
			select {
			case <-stuck:
			case <-time.After(30 * time.Second):
				t.Fatal("A never got to its 1501st message")
			}
			var handledB atomic.Int64
			runRouter(t, b.subscriber(t, cfg(nil)), topic, func(*message.Message) error {
				handledB.Add(1)
				return nil
			})
			// Half a lease would be 15 s: the buffer goes back within about
			// two seconds (a second's patience, the next check).
			pollUntil(t, "A gives its buffer back", 8*time.Second, nil, func() bool { return evA.countKind(pgoutbox.EventReleased) > 0 })
			waitCount(t, "messages handled by B", n-1500-inFlight, time.Minute, func() int { return int(handledB.Load()) })
			t.Logf("%s: A handled 1500 and holds %d in its handlers; B handled %d; A gave back %d",
				mode, inFlight, handledB.Load(), evA.countKind(pgoutbox.EventReleased))
			require.Positive(t, evA.countKind(pgoutbox.EventReleased), "A held rows beyond its handlers, and gave them back")
		})
	}
}

// A held claim stays at 256 rows (MaxInFlight when more) where a lease
// claim of a busy subscription takes up to 1,024: a crash rolls the open
// held batches back, handled rows too, and the docs bound what runs twice
// by 3 × 256 (QA: with held claims of 1,024, a kill -9 ran 2,326 messages
// twice). A fast drain in each mode that holds, its claims' sizes from
// the Observer.
func TestHeldClaimsStayAtTheirSizeWhereLeaseClaimsGrow(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimHeld, pgoutbox.ClaimAuto} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const n = 30000
			b.publishInTx(t, "t", true, newMsgs(n)...)
			ev := newEvents()
			sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
				c.MaxInFlight = 16
				c.ClaimMode = mode
				c.Observer = ev
			})
			var handled atomic.Int64
			runRouter(t, sub, "t", func(*message.Message) error {
				handled.Add(1)
				return nil
			})
			waitCount(t, "handled", n, 60*time.Second, func() int { return int(handled.Load()) })
			largest := map[string]int{}
			ev.mu.Lock()
			for _, e := range ev.list {
				if e.Kind == pgoutbox.EventClaimed {
					largest[e.Path] = max(largest[e.Path], e.Count)
				}
			}
			ev.mu.Unlock()
			t.Logf("%s: largest claim by path %v", mode, largest)
			require.Positive(t, largest[pgoutbox.PathHeld], "the drain was held")
			require.LessOrEqual(t, largest[pgoutbox.PathHeld], 256)
		})
	}
}
