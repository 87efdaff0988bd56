package tests

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// A Watermill middleware stack over pgoutbox: Retry gives up, DelayOnError
// schedules the failure, PoisonQueue publishes it to a pgoutbox poison topic
// with Watermill's reason metadata, and CorrelationID carries the id across
// both hops.
func TestRouterMiddlewareStack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pub := b.poolPublisher(t)
	poison, err := middleware.PoisonQueue(pub, "orders.poison")
	require.NoError(t, err)

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(
		middleware.CorrelationID,
		poison,
		(&middleware.DelayOnError{InitialInterval: 300 * time.Millisecond, MaxInterval: time.Second, Multiplier: 2}).Middleware,
		middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond}.Middleware,
		pgoutbox.ErrorRecorder,
	)
	var attempts atomic.Int32
	r.AddConsumerHandler("charge", "orders", b.subscriber(t, nil), func(*message.Message) error {
		attempts.Add(1)
		return errors.New("card declined")
	})
	// A handler that succeeds and produces a message: CorrelationID copies
	// the id onto it.
	r.AddHandler("forward", "orders.ok", b.subscriber(t, nil), "orders.shipped", pub, func(m *message.Message) ([]*message.Message, error) {
		return []*message.Message{newMsg("shipped " + string(m.Payload))}, nil
	})
	poisoned := make(chan *message.Message, 1)
	scheduledMs := make(chan float64, 1)
	r.AddConsumerHandler("poison-inbox", "orders.poison", b.subscriber(t, nil), func(m *message.Message) error {
		// While the handler runs the row still exists: how far after its
		// insert was it scheduled (both by the database clock)?
		var ms float64
		err := b.Pool.QueryRow(ctx, `SELECT 1000 * extract(epoch FROM available_at - created_at) FROM `+b.Schema+`.outbox
			WHERE topic = 'orders.poison'`).Scan(&ms)
		if err != nil {
			return err
		}
		scheduledMs <- ms
		poisoned <- m
		return nil
	})
	shipped := make(chan *message.Message, 1)
	r.AddConsumerHandler("shipped-inbox", "orders.shipped", b.subscriber(t, nil), func(m *message.Message) error {
		shipped <- m
		return nil
	})
	startRouter(t, r)

	failing := newMsg("order-1")
	middleware.SetCorrelationID("corr-failing", failing)
	ok := newMsg("order-2")
	middleware.SetCorrelationID("corr-ok", ok)
	b.publishInTx(t, "orders", true, failing)
	b.publishInTx(t, "orders.ok", true, ok)

	var p *message.Message
	select {
	case p = <-poisoned:
	case <-time.After(20 * time.Second):
		t.Fatal("nothing reached the poison topic")
	}
	require.Equal(t, failing.UUID, p.UUID)
	require.Equal(t, "order-1", string(p.Payload))
	require.Contains(t, p.Metadata.Get(middleware.ReasonForPoisonedKey), "card declined")
	require.Equal(t, "orders", p.Metadata.Get(middleware.PoisonedTopicKey))
	require.Equal(t, "charge", p.Metadata.Get(middleware.PoisonedHandlerKey))
	require.Equal(t, "corr-failing", middleware.MessageCorrelationID(p))
	// Delay keys are instructions to a publisher, already applied: they
	// are not handed to the poison topic's consumer.
	require.Empty(t, p.Metadata.Get(delay.DelayedForKey))
	require.Empty(t, p.Metadata.Get(delay.DelayedUntilKey))
	require.Equal(t, int32(3), attempts.Load(), "one try and two retries")

	// The poison publish honoured DelayOnError's delay: the row was
	// scheduled 300ms after it was written.
	require.InDelta(t, 300, <-scheduledMs, 1)

	select {
	case s := <-shipped:
		require.Equal(t, "shipped order-2", string(s.Payload))
		require.Equal(t, "corr-ok", middleware.MessageCorrelationID(s))
	case <-time.After(20 * time.Second):
		t.Fatal("the produced message did not arrive")
	}
	// The failing order was acked once it was in the poison topic.
	require.Eventually(t, func() bool { return b.outboxRows(t, "orders") == 0 }, 10*time.Second, 20*time.Millisecond)
}

// Watermill's DelayOnError sets the delay on the nacked message; the
// subscriber uses it (over its retry policy) and stores the changed
// metadata, so the delay grows across redeliveries as with Watermill's SQL
// Pub/Sub.
func TestDelayOnErrorGrowsAcrossRedeliveries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.RetryPolicy = pgoutbox.ConstantBackoff{Delay: time.Hour} // must not be used
		c.Observer = ev
	})
	b.publishInTx(t, "t", true, newMsg("x"))

	seen := &list{}
	done := make(chan struct{})
	runRouter(t, sub, "t", func(m *message.Message) error {
		if seen.add(m.Metadata.Get(delay.DelayedForKey)) == 4 {
			close(done)
			return nil
		}
		return errors.New("not yet")
	}, (&middleware.DelayOnError{InitialInterval: 50 * time.Millisecond, MaxInterval: time.Second, Multiplier: 2}).Middleware, pgoutbox.ErrorRecorder)

	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("handled %d times, want 4 (delays seen: %v)", len(seen.get()), seen.get())
	}
	require.Equal(t, []string{"", "50ms", "100ms", "200ms"}, seen.get())
	require.Equal(t, 3, ev.countKind(pgoutbox.EventRetried))
}

// delay.NewPublisher over a pgoutbox publisher schedules messages.
func TestWatermillDelayPublisher(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	delayed, err := delay.NewPublisher(b.poolPublisher(t), delay.PublisherConfig{
		DefaultDelayGenerator: func(delay.DefaultDelayGeneratorParams) (delay.Delay, error) {
			return delay.For(time.Hour), nil
		},
	})
	require.NoError(t, err)
	soon := newMsg("soon")
	soon.SetContext(delay.WithContext(ctx, delay.For(2*time.Second)))
	require.NoError(t, delayed.Publish("t", newMsg("later"), soon))

	rows, err := b.Pool.Query(ctx, `SELECT payload, extract(epoch FROM available_at - created_at) FROM `+b.Schema+`.outbox ORDER BY id`)
	require.NoError(t, err)
	got := map[string]float64{}
	for rows.Next() {
		var p []byte
		var s float64
		require.NoError(t, rows.Scan(&p, &s))
		got[string(p)] = s
	}
	require.NoError(t, rows.Err())
	require.InDelta(t, 3600, got["later"], 0.01)
	require.InDelta(t, 2, got["soon"], 0.01)
}

// A nacked message comes again with the metadata it was published with,
// as from a broker: what a handler or middleware wrote into it (a scratch
// key, PoisonQueue's reason keys on a failed poison publish, a deleted
// key) is not stored with the nack. Every claim path.
func TestARedeliveryCarriesThePublishedMetadata(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		m := newMsg("x")
		m.Metadata.Set("customer_id", "c-7")
		b.publishInTx(t, "t", true, m)
		ch, err := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { onPath(t, path, c) }).Subscribe(context.Background(), "t")
		require.NoError(t, err)
		got := receive(t, ch, 10*time.Second)
		delete(got.Metadata, "customer_id")
		got.Metadata.Set("reason_poisoned", "fail once")
		got.Nack()
		again := receive(t, ch, 10*time.Second)
		require.Equal(t, "c-7", again.Metadata.Get("customer_id"))
		require.NotContains(t, again.Metadata, "reason_poisoned")
		again.Ack()
	})
}

// Watermill's delay keeps the time it was asked for: "delayed until" to
// its second, "delayed for" (finer) only where the two agree. delay.Until
// in a transaction begun an hour before (its "for" an hour short of the
// transaction's now()), and delay.For on a message built an hour before its
// publish (an hour long), were counted from the transaction's start: the
// one delivered an hour early, the other an hour late.
func TestWatermillDelayKeepsTheTimeAskedFor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	until := time.Now().Add(2 * time.Hour)
	early, late, fine := newMsg("early"), newMsg("late"), newMsg("fine")
	for m, forKey := range map[*message.Message]string{early: "1h0m0s", late: "3h0m0s"} {
		delay.Message(m, delay.Until(until))
		m.Metadata.Set(delay.DelayedForKey, forKey)
	}
	delay.Message(fine, delay.For(1500*time.Millisecond))
	// Cut to the second and computed most of a second before the statement
	// (a loaded machine): "for" lands up to two seconds after "until", and
	// the two still agree. With one second allowed, an hour's delay came
	// out a second short.
	lagged := newMsg("lagged")
	lagged.Metadata.Set(delay.DelayedUntilKey, time.Now().Add(time.Hour-900*time.Millisecond).Truncate(time.Second).Format(time.RFC3339))
	lagged.Metadata.Set(delay.DelayedForKey, time.Hour.String())
	require.NoError(t, b.poolPublisher(t).Publish("t", early, late, fine, lagged))
	due := func(m *message.Message) (at time.Time, after time.Duration) {
		require.NoError(t, b.Pool.QueryRow(ctx, `SELECT available_at, available_at - created_at FROM `+b.Schema+`.outbox WHERE uuid = $1`, m.UUID).Scan(&at, &after))
		return at, after
	}
	for _, m := range []*message.Message{early, late} {
		at, _ := due(m)
		require.True(t, at.Equal(until.Truncate(time.Second)), "%s: due at the time asked for (%s), not %s", m.Payload, until.Truncate(time.Second), at)
	}
	_, after := due(fine)
	require.Equal(t, 1500*time.Millisecond, after, "where they agree, the finer duration")
	_, after = due(lagged)
	require.Equal(t, time.Hour, after, "an until cut to the second and a moment old agrees with its duration")
}

// The README's stack, with a transactional handler that outlives its
// message's AckDeadline without watching its context (a client call
// without one): the message is delivered again, and its first attempt's
// commit finds the lease gone (tx.ErrLeaseLost). The PoisonQueue filter
// must leave that error alone: a poison copy of a message that was also
// handled by its redelivery would be handled twice when sent back.
func TestReadmeStackDoesNotPoisonAMessageWhoseLeaseWasLost(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		ctx := context.Background()
		const topic, poisonTopic = "orders.placed", "orders.poison"
		require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, poisonTopic, ""))
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			onPath(t, path, c)
			c.AckDeadline = 300 * time.Millisecond
		})
		pub, err := pgoutbox.NewContextPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
		require.NoError(t, err)
		txMiddleware, err := tx.Middleware(tx.FromPgxPool(b.Pool), tx.MiddlewareConfig{Publisher: pub})
		require.NoError(t, err)
		poisonQueue, err := middleware.PoisonQueueWithFilter(pub, poisonTopic, func(err error) bool {
			return !errors.Is(err, pgoutbox.ErrRejected) && !pgoutbox.Redelivered(err)
		})
		require.NoError(t, err)
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, b.logger)
		require.NoError(t, err)
		// Outermost: what came out of the whole stack, per attempt.
		results := make(chan error, 4)
		router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				msgs, err := h(msg)
				results <- err
				return msgs, err
			}
		},
			pgoutbox.ErrorRecorder,
			poisonQueue,
			middleware.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond}.Middleware,
			middleware.Recoverer,
			txMiddleware,
			middleware.CorrelationID,
		)
		var runs atomic.Int32
		router.AddConsumerHandler("confirm", topic, sub, func(msg *message.Message) error {
			if runs.Add(1) == 1 {
				time.Sleep(time.Second) // past AckDeadline, not watching the context
			}
			return nil
		})
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		routerErr := make(chan error, 1)
		go func() { routerErr <- router.Run(rctx) }()
		<-router.Running()
		require.NoError(t, b.poolPublisher(t).Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("order-1"))))

		// The redelivery's attempt and the first one's, in either order.
		for range 2 {
			select {
			case <-results:
			case <-time.After(20 * time.Second):
				t.Fatalf("the handler's attempts did not both end (runs: %d)", runs.Load())
			}
		}
		require.EqualValues(t, 2, runs.Load(), "delivered again after its AckDeadline")
		b.RequireNotPublished(t, b.Exec(), poisonTopic)
		require.NoError(t, router.Close())
		require.NoError(t, <-routerErr)
	})
}
