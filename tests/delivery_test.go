package tests

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// runRouter runs a router with one consumer handler until the test ends.
func runRouter(t *testing.T, sub message.Subscriber, topic string, h message.NoPublishHandlerFunc, mw ...message.HandlerMiddleware) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(mw...)
	r.AddConsumerHandler("handler-"+topic, topic, sub, h)
	startRouter(t, r)
	return r
}

func startRouter(t *testing.T, r *message.Router) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-done)
	})
}

type dlqRow struct {
	reason, lastError string
	deliveries        int
	payload           []byte
}

func (b *bundle) dlq(t *testing.T, uuid string) dlqRow {
	t.Helper()
	var r dlqRow
	var lastErr *string
	require.NoError(t, b.Pool.QueryRow(context.Background(),
		`SELECT failure_reason, last_error, deliveries, payload FROM `+b.Schema+`.outbox_dlq WHERE uuid = $1`, uuid).
		Scan(&r.reason, &lastErr, &r.deliveries, &r.payload))
	if lastErr != nil {
		r.lastError = *lastErr
	}
	return r
}

func TestRetryThenSuccess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 50 * time.Millisecond, MaxAttempts: 5}
		c.Observer = ev
	})
	msg := newMsg("x")
	b.publishInTx(t, "t", true, msg)

	var calls atomic.Int32
	// Filled by the handler, asserted on the test goroutine: require must
	// not run in the Router's goroutines.
	var seenLastErrors, queryErrors list
	done := make(chan struct{})
	var doneOnce sync.Once
	runRouter(t, sub, "t", func(m *message.Message) error {
		n := calls.Add(1)
		var lastErr *string
		if err := b.Pool.QueryRow(context.Background(), `SELECT last_error FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID).Scan(&lastErr); err != nil {
			queryErrors.add(err.Error())
			return err
		}
		if lastErr != nil {
			seenLastErrors.add(*lastErr)
		}
		if n < 3 {
			return fmt.Errorf("boom %d", n)
		}
		doneOnce.Do(func() { close(done) })
		return nil
	}, pgoutbox.ErrorRecorder)

	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatalf("not handled successfully (handler errors reading last_error: %q)", queryErrors.get())
	}
	ev.wait(t, pgoutbox.EventAcked, 10*time.Second)
	require.Empty(t, queryErrors.get(), "the handler's look at last_error failed")
	require.Equal(t, int32(3), calls.Load())
	require.Equal(t, []string{"boom 1", "boom 2"}, seenLastErrors.get(), "each retry sees the previous delivery's error")
	require.Equal(t, 2, ev.countKind(pgoutbox.EventRetried))
	require.Equal(t, 0, b.outboxRows(t, "t"))
}

func TestRetryExhaustedGoesToDeadLetters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: 3}
		c.Observer = ev
	})
	msg := newMsg("doomed")
	msg.Metadata.Set("k", "v")
	b.publishInTx(t, "t", true, msg)
	var calls atomic.Int32
	runRouter(t, sub, "t", func(*message.Message) error {
		calls.Add(1)
		return errors.New("always failing")
	}, pgoutbox.ErrorRecorder)

	dead := ev.wait(t, pgoutbox.EventDeadLettered, 15*time.Second)
	require.Equal(t, pgoutbox.ReasonRetryExhausted, dead.Reason)
	row := b.dlq(t, msg.UUID)
	require.Equal(t, pgoutbox.ReasonRetryExhausted, row.reason)
	require.Equal(t, "always failing", row.lastError)
	require.Equal(t, 3, row.deliveries)
	require.Equal(t, "doomed", string(row.payload))
	require.Equal(t, int32(3), calls.Load())
	require.Equal(t, 0, b.outboxRows(t, "t"))
	var meta string
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT metadata->>'k' FROM `+b.Schema+`.outbox_dlq`).Scan(&meta))
	require.Equal(t, "v", meta)
}

func TestRejectDeadLettersAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.DefaultRetryPolicy()
		c.Observer = ev
	})
	msg := newMsg("{not json")
	b.publishInTx(t, "t", true, msg)
	var calls atomic.Int32
	runRouter(t, sub, "t", func(m *message.Message) error {
		calls.Add(1)
		return pgoutbox.Reject(m, "payload is not JSON")
	}, pgoutbox.ErrorRecorder)

	dead := ev.wait(t, pgoutbox.EventDeadLettered, 15*time.Second)
	require.Equal(t, pgoutbox.ReasonRejected, dead.Reason)
	row := b.dlq(t, msg.UUID)
	require.Equal(t, pgoutbox.ReasonRejected, row.reason)
	require.Contains(t, row.lastError, "payload is not JSON")
	require.Equal(t, 1, row.deliveries)
	require.Equal(t, int32(1), calls.Load())
}

// TestTheReturnedErrorDecidesARejection: with ErrorRecorder, a handler
// that called Reject, handled its error and failed otherwise is retried
// (it was dead-lettered as rejected on its first failure), and an error
// the handler wrapped around ErrRejected itself is a rejection (it went
// through the whole retry policy). Without ErrorRecorder the subscriber
// sees no error, and Reject's mark decides. On every claim path.
func TestTheReturnedErrorDecidesARejection(t *testing.T) {
	t.Parallel()
	for _, recorded := range []bool{true, false} {
		t.Run(fmt.Sprintf("ErrorRecorder=%v", recorded), func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				b := setup(t)
				ev := newEvents()
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: 3}
					c.Observer = ev
				})
				recovered, wrapped, marked := newMsg("recovered"), newMsg("wrapped"), newMsg("marked")
				b.publishInTx(t, "t", true, recovered, wrapped, marked)
				var recoveredCalls atomic.Int32
				var mw []message.HandlerMiddleware
				if recorded {
					mw = append(mw, pgoutbox.ErrorRecorder)
				}
				runRouter(t, sub, "t", func(m *message.Message) error {
					switch string(m.Payload) {
					case "recovered":
						if recoveredCalls.Add(1) == 1 {
							_ = pgoutbox.Reject(m, "legacy payload") // handled: converted instead
							return errors.New("converter unavailable")
						}
						return nil
					case "wrapped":
						return fmt.Errorf("order id missing: %w", pgoutbox.ErrRejected)
					default:
						return pgoutbox.Reject(m, "marked")
					}
				}, mw...)

				want := map[string]string{marked.UUID: pgoutbox.ReasonRejected}
				if recorded {
					want[wrapped.UUID] = pgoutbox.ReasonRejected
				} else {
					want[wrapped.UUID] = pgoutbox.ReasonRetryExhausted // no error seen: an ordinary failure
					want[recovered.UUID] = pgoutbox.ReasonRejected     // only the mark tells
				}
				for range want {
					ev.wait(t, pgoutbox.EventDeadLettered, 15*time.Second)
				}
				got := map[string]string{}
				for id := range want {
					got[id] = b.dlq(t, id).reason
				}
				require.Equal(t, want, got)
				if recorded {
					require.Equal(t, 1, b.dlq(t, wrapped.UUID).deliveries)
					require.Contains(t, b.dlq(t, wrapped.UUID).lastError, "order id missing")
					require.Eventually(t, func() bool { return b.outboxRows(t, "t") == 0 }, 10*time.Second, 10*time.Millisecond)
					require.Equal(t, int32(2), recoveredCalls.Load(), "retried after the error it returned, then acked")
				}
			})
		})
	}
}

func TestMaxDeliveriesDeadLettersWithoutRunningHandler(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MaxDeliveries = 5
		c.Observer = ev
	})
	crashLooper, next := newMsg("kills the process"), newMsg("fine")
	b.publishInTx(t, "t", true, crashLooper, next)
	// Five deliveries whose process died before any verdict was written.
	_, err := b.Pool.Exec(context.Background(), `UPDATE `+b.Schema+`.outbox SET deliveries = 5 WHERE uuid = $1`, crashLooper.UUID)
	require.NoError(t, err)

	handled := make(chan string, 2)
	runRouter(t, sub, "t", func(m *message.Message) error {
		handled <- string(m.Payload)
		return nil
	})
	select {
	case got := <-handled:
		require.Equal(t, "fine", got)
	case <-time.After(10 * time.Second):
		t.Fatal("the next message was not handled")
	}
	dead := ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	require.Equal(t, pgoutbox.ReasonMaxDeliveries, dead.Reason)
	require.Equal(t, 6, b.dlq(t, crashLooper.UUID).deliveries)
	requireNoString(t, handled, 200*time.Millisecond)
}

func requireNoString(t *testing.T, ch <-chan string, d time.Duration) {
	t.Helper()
	select {
	case s := <-ch:
		t.Fatalf("unexpected %q", s)
	case <-time.After(d):
	}
}

func TestPoisonedRowIsDeadLetteredAndTopicGoesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.Observer = ev })
	// A row written by hand whose metadata is not a map of strings.
	_, err := b.Pool.Exec(context.Background(), `INSERT INTO `+b.Schema+`.outbox (topic, uuid, payload, metadata)
		VALUES ('t', 'poison', 'x', '{"attempt": 1}')`)
	require.NoError(t, err)
	b.publishInTx(t, "t", true, newMsg("good"))

	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "good", string(m.Payload))
	m.Ack()
	require.Equal(t, pgoutbox.EventPoisoned, ev.wait(t, pgoutbox.EventPoisoned, 10*time.Second).Kind)
	dead := ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	require.Equal(t, pgoutbox.ReasonPoisoned, dead.Reason)
	row := b.dlq(t, "poison")
	require.Equal(t, pgoutbox.ReasonPoisoned, row.reason)
	require.Contains(t, row.lastError, "metadata")
}

// Defect: without a dead-letter table, a message whose retry policy gave up
// was deleted. Now it is parked in the outbox, never due again, with its
// reason and error, and nothing is deleted without an ack.
func TestTerminalFailureWithoutDeadLetterTableParksTheRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &logCapture{}
	ev := newEvents()
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{
		Tables:          schema.Config{Schema: b.Schema, Table: "outbox", NoDeadLetterTable: true},
		RetryPolicy:     pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: 2},
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: 200 * time.Millisecond,
		Observer:        ev,
	}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	exhausted, rejected := newMsg("exhausted"), newMsg("rejected")
	b.publishInTx(t, "t", true, exhausted, rejected)
	var calls atomic.Int32
	runRouter(t, sub, "t", func(m *message.Message) error {
		calls.Add(1)
		if string(m.Payload) == "rejected" {
			return pgoutbox.Reject(m, "nope")
		}
		return errors.New("downstream is down")
	}, pgoutbox.ErrorRecorder)

	ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	ev.wait(t, pgoutbox.EventDeadLettered, 10*time.Second)
	type parked struct {
		reason, lastError string
		infinite, leased  bool
	}
	get := func(uuid string) parked {
		var p parked
		require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT failure_reason, last_error,
			available_at = 'infinity', lease_token IS NOT NULL FROM `+b.Schema+`.outbox WHERE uuid = $1`, uuid).
			Scan(&p.reason, &p.lastError, &p.infinite, &p.leased))
		return p
	}
	require.Equal(t, parked{pgoutbox.ReasonRetryExhausted, "downstream is down", true, false}, get(exhausted.UUID))
	require.Equal(t, parked{pgoutbox.ReasonRejected, "pgoutbox: message rejected: nope", true, false}, get(rejected.UUID))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
	for _, uuid := range []string{exhausted.UUID, rejected.UUID} {
		require.Len(t, logs.find("info", func(e logEntry) bool {
			return e.fields["message_uuid"] == uuid && e.fields["severity"] == "warn" && e.fields["event"] == "dead_lettered"
		}), 1, "parking is logged with its reason")
	}

	// Parked rows are never delivered again, and the idle loop does not
	// trip over their infinite due time.
	before := calls.Load()
	require.Equal(t, int32(3), before, "two deliveries, then one")
	for empty := 0; empty < 3; {
		if e := ev.wait(t, pgoutbox.EventClaimed, 5*time.Second); e.Count == 0 {
			empty++ // an idle poll that found nothing
		}
	}
	require.Equal(t, before, calls.Load())
	require.Equal(t, 2, b.outboxRows(t, "t"))
}

// If the dead-letter insert fails, the row stays (leased) and comes back
// when its lease expires, and it is moved once the insert can succeed: never
// lost. Meanwhile the failing row does not hold up the other messages' acks.
func TestDeadLetterInsertFailureKeepsTheRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ev := newEvents()
	logs := &logCapture{}
	sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: b.tables, Observer: ev, Lease: 2 * time.Second}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = b.Pool.Exec(ctx, `ALTER TABLE `+b.Schema+`.outbox_dlq ADD CONSTRAINT refuse CHECK (failure_reason <> 'rejected')`)
	require.NoError(t, err)
	doomed := newMsg("reject me")
	others := []*message.Message{newMsg("a"), newMsg("b"), newMsg("c")}
	b.publishInTx(t, "t", true, append([]*message.Message{doomed}, others...)...)
	var attempts atomic.Int32
	runRouter(t, sub, "t", func(m *message.Message) error {
		if m.UUID == doomed.UUID {
			attempts.Add(1)
			return pgoutbox.Reject(m, "nope")
		}
		return nil
	})

	require.Eventually(t, func() bool {
		return len(logs.find("error", func(e logEntry) bool { return strings.Contains(fmt.Sprint(e.err), "refuse") })) > 0
	}, 10*time.Second, 10*time.Millisecond, "the failing dead-letter write must be reported")
	require.Eventually(t, func() bool { return b.outboxRows(t, "t") == 1 }, 10*time.Second, 10*time.Millisecond,
		"the other messages are acked although one row cannot be dead-lettered")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = $1`, doomed.UUID), "the failing row stays")

	_, err = b.Pool.Exec(ctx, `ALTER TABLE `+b.Schema+`.outbox_dlq DROP CONSTRAINT refuse`)
	require.NoError(t, err)
	ev.wait(t, pgoutbox.EventDeadLettered, 15*time.Second)
	require.Equal(t, pgoutbox.ReasonRejected, b.dlq(t, doomed.UUID).reason)
	require.Equal(t, 0, b.outboxRows(t, "t"))
	require.GreaterOrEqual(t, attempts.Load(), int32(2), "the row came back after its lease expired")
}

// A handler error that PostgreSQL text cannot hold (NUL, invalid UTF-8) is
// cleaned before it is stored: it must not fail the batched write every
// other ack of the subscription travels in. Metadata the handler changed
// is not stored at all.
func TestUnstorableErrorTextDoesNotStopTheSubscription(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Hour}
		c.MaxInFlight = 4
		c.Observer = ev
	})
	bad := newMsg("bad")
	msgs := []*message.Message{bad}
	for i := range 20 {
		msgs = append(msgs, newMsg(fmt.Sprint(i)))
	}
	b.publishInTx(t, "t", true, msgs...)
	runRouter(t, sub, "t", func(m *message.Message) error {
		if m.UUID == bad.UUID {
			m.Metadata.Set("note\x00", "bad \xff value\x00")
			return errors.New("boom\x00 \xff")
		}
		return nil
	}, pgoutbox.ErrorRecorder)

	require.Eventually(t, func() bool { return b.outboxRows(t, "t") == 1 }, 10*time.Second, 10*time.Millisecond)
	ev.wait(t, pgoutbox.EventRetried, 10*time.Second)
	var lastErr string
	var note *string
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT last_error, metadata->>'note' FROM `+b.Schema+`.outbox`).Scan(&lastErr, &note))
	require.Equal(t, "boom \uFFFD", lastErr)
	require.Nil(t, note, "a handler's metadata edit is not stored with the nack")
}

func TestLastErrorIsBounded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Hour}
		c.Observer = ev
	})
	b.publishInTx(t, "t", true, newMsg("x"))
	runRouter(t, sub, "t", func(*message.Message) error {
		return errors.New(strings.Repeat("validation failed; ", 10000))
	}, pgoutbox.ErrorRecorder)
	ev.wait(t, pgoutbox.EventRetried, 10*time.Second)
	var lastErr string
	require.NoError(t, b.Pool.QueryRow(context.Background(), `SELECT last_error FROM `+b.Schema+`.outbox`).Scan(&lastErr))
	require.LessOrEqual(t, len(lastErr), 8<<10)
	require.True(t, strings.HasPrefix(lastErr, "validation failed; "))
	require.True(t, strings.HasSuffix(lastErr, "…[truncated]"))
}

// Concurrency-safe list of strings for handlers.
type list struct {
	mu    sync.Mutex
	items []string
}

func (l *list) add(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.items = append(l.items, s)
	return len(l.items)
}

func (l *list) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.items...)
}

// A RetryPolicy that panics took the process down at the message's first
// nack, and every process after it at the redelivery: the panic is logged
// and the default policy decides (a redelivery after about a second).
// A retry delay near the largest Duration ("never again, in practice")
// waits, ordered or not: an ordered subscription added it to its clock,
// which wrapped to a time in the past and redelivered at once, hundreds
// of times a second.
func TestALongestRetryDelayWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, inFlight := range []int{1, 4} {
		t.Run(fmt.Sprintf("in-flight-%d", inFlight), func(t *testing.T) {
			onEachClaimPath(t, func(t *testing.T, path string) {
				topic := fmt.Sprintf("longest-delay-%d-%s", inFlight, path)
				ev := newEvents()
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.Observer, c.MaxInFlight = ev, inFlight
					c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: math.MaxInt64, MaxAttempts: pgoutbox.RetryForever}
				})
				msgs, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)
				require.NoError(t, b.poolPublisher(t).Publish(topic, newMsgs(1)...))
				receive(t, msgs, 10*time.Second).Nack()
				ev.wait(t, pgoutbox.EventRetried, 10*time.Second)
				select {
				case m := <-msgs:
					info, _ := pgoutbox.DeliveryOf(m)
					t.Fatalf("delivered again at once (attempt %d)", info.Attempt)
				case <-time.After(time.Second):
				}
			})
		})
	}
}

// An ordered subscription's retry goes out when its delay ends, not at
// the owner's next housekeeping (up to a second later): the count of the
// retried delivery, written when the delay ends, was queued after the
// owner had started its writes for that turn, so it waited for the next
// event: ten retries 50 ms apart took five seconds (housekeeping every
// half second with these tests' leases), and take under one now.
func TestAnOrderedRetryGoesOutWhenItsDelayEnds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		topic := "ordered-retry-on-time-" + path
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.MaxInFlight = 1
			c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: 50 * time.Millisecond, MaxAttempts: pgoutbox.RetryForever}
		})
		msgs, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		require.NoError(t, b.poolPublisher(t).Publish(topic, newMsgs(1)...))
		receive(t, msgs, 10*time.Second).Nack()
		start := time.Now()
		for attempt := 2; attempt <= 11; attempt++ {
			m := receive(t, msgs, 10*time.Second)
			info, _ := pgoutbox.DeliveryOf(m)
			require.Equal(t, attempt, info.Attempt)
			if attempt < 11 {
				m.Nack()
			} else {
				m.Ack()
			}
		}
		require.Less(t, time.Since(start), 2500*time.Millisecond, "ten retries 50 ms apart")
	})
}

func TestPanickingRetryPolicyFallsBackToTheDefault(t *testing.T) {
	t.Parallel()
	b := setup(t)
	onEachClaimPath(t, func(t *testing.T, path string) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		topic := "panicking-policy-" + path
		var asked atomic.Int32
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.RetryPolicy = pgoutbox.RetryPolicyFunc(func(int, error) (time.Duration, bool) {
				asked.Add(1)
				panic("a bug in the policy")
			})
		})
		msgs, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		sent := newMsgs(1)
		require.NoError(t, b.poolPublisher(t).Publish(topic, sent...))
		for delivery := 1; delivery <= 2; delivery++ {
			select {
			case m := <-msgs:
				require.Equal(t, sent[0].UUID, m.UUID)
				if delivery == 1 {
					m.Nack()
				} else {
					m.Ack()
				}
			case <-ctx.Done():
				t.Fatalf("delivery %d did not come", delivery)
			}
		}
		require.EqualValues(t, 1, asked.Load())
	})
}
