package tests

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// universalFeatures is what pgoutbox honestly provides: at-least-once
// (duplicates are possible after a lease expiry, so ExactlyOnceDelivery is
// false, which also runs the close/continue cases), persistence, and publish
// order per topic for one subscription with MaxInFlight 1. Competing
// subscriptions of one topic interleave, hence "with single subscriber".
func universalFeatures() tests.Features {
	return tests.Features{
		ConsumerGroups:                      true,
		ExactlyOnceDelivery:                 false,
		GuaranteedOrder:                     true,
		GuaranteedOrderWithSingleSubscriber: true,
		Persistent:                          true,
	}
}

// universalGroupConstructor is universalConstructor for a consumer group.
func universalGroupConstructor(b *bundle, mode pgoutbox.ClaimMode) tests.ConsumerGroupPubSubConstructor {
	return func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		return universalPubSub(t, b, universalConfig(b, group, mode))
	}
}

// universalConstructor shares one pool (and so one LISTEN connection) among
// the dozens of pub/subs the suite builds, keeping the run far below the
// server's max_connections.
func universalConstructor(b *bundle, mode pgoutbox.ClaimMode) tests.PubSubConstructor {
	return func(t *testing.T) (message.Publisher, message.Subscriber) {
		return universalPubSub(t, b, universalConfig(b, "", mode))
	}
}

// universalConfig is the subscribers' configuration for the suite.
func universalConfig(b *bundle, group string, mode pgoutbox.ClaimMode) pgoutbox.SubscriberConfig {
	return pgoutbox.SubscriberConfig{
		Tables:          b.tables,
		ConsumerGroup:   group,
		Lease:           5 * time.Second,
		MinPollInterval: 10 * time.Millisecond,
		MaxPollInterval: time.Second,
		DrainTimeout:    time.Second,
		// The suite nacks one message hundreds of times in a row.
		RetryPolicy: pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: -1},
		ClaimMode:   mode,
		// A rotating outbox's ring turns within every case.
		RotationWindow: time.Second,
	}
}

func universalPubSub(t *testing.T, b *bundle, cfg pgoutbox.SubscriberConfig) (message.Publisher, message.Subscriber) {
	pub := b.poolPublisher(t)
	sub, err := pgoutbox.NewSubscriber(b.Pool, cfg, b.logger)
	require.NoError(t, err)
	// Some cases of the suite leave their subscriber open; it must end
	// before the shared pool closes at the end of the whole suite.
	t.Cleanup(func() { _ = sub.Close() })
	return pub, sub
}

// TestPubSub runs Watermill's universal Pub/Sub suite. TestReconnect is
// skipped here and run on its own (below), since a server restart would
// break the packages running in parallel.
func TestPubSub(t *testing.T) {
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	tests.TestPubSub(t, universalFeatures(), universalConstructor(b, pgoutbox.ClaimAuto), universalGroupConstructor(b, pgoutbox.ClaimAuto))
}

// TestPubSubRotating runs the suite on a rotating outbox
// (schema.Config.Rotating), whose subscribers rotate it every second.
func TestPubSubRotating(t *testing.T) {
	env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{MaxConns: 20, Rotating: true})
	b := &bundle{Env: env, tables: env.Tables, logger: watermill.NopLogger{}}
	// The sequence's value changes only when the ring advances.
	seq := `SELECT pg_sequence_last_value('` + b.Schema + `.outbox_generation')::text`
	var start string
	require.NoError(t, b.Pool.QueryRow(context.Background(), seq).Scan(&start))
	// After the suite's parallel cases, before the schema goes.
	t.Cleanup(func() {
		var end string
		require.NoError(t, b.Pool.QueryRow(context.Background(), seq).Scan(&end))
		require.NotEqual(t, start, end, "the ring turned during the suite")
	})
	tests.TestPubSub(t, universalFeatures(), universalConstructor(b, pgoutbox.ClaimAuto), universalGroupConstructor(b, pgoutbox.ClaimAuto))
}

// TestPubSubEachClaimPath runs the suite again on each claim path alone:
// ClaimAuto picks per claim (and leases when the shared pool is short of
// connections), so either path could otherwise go untested in a case.
func TestPubSubEachClaimPath(t *testing.T) {
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimHeld, pgoutbox.ClaimLease} {
		t.Run(mode.String(), func(t *testing.T) {
			b := setup(t, pgoutboxtest.Options{MaxConns: 30})
			tests.TestPubSub(t, universalFeatures(), universalConstructor(b, mode), universalGroupConstructor(b, mode))
		})
	}
}

// TestReconnect runs the suite's reconnect case: 10,000 messages while the
// server restarts twice. It needs PGOUTBOX_TEST_RESTART_CMD, a shell command
// that restarts the server (`make test` runs it separately, after the rest).
func TestReconnect(t *testing.T) {
	cmd := os.Getenv("PGOUTBOX_TEST_RESTART_CMD")
	if cmd == "" {
		t.Skip("PGOUTBOX_TEST_RESTART_CMD is not set; it restarts PostgreSQL (see Makefile target test)")
	}
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	features := universalFeatures()
	features.RestartServiceCommand = []string{"sh", "-c", cmd}
	cfg := universalConfig(b, "", pgoutbox.ClaimAuto)
	cfg.MaxInFlight = reconnectInFlight
	construct := func(t *testing.T) (message.Publisher, message.Subscriber) {
		pub, sub := universalPubSub(t, b, cfg)
		return pub, &recordedFirst{Subscriber: sub, after: reconnectRecordLag}
	}
	tests.TestReconnect(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, construct)
}

// The suite's reconnect case records a message as published on a goroutine
// of its own, fed by a channel after Publish returned, and compares the
// record with what was received as soon as the last message arrives. A
// delivery quicker than that goroutine's next turn (LISTEN/NOTIFY takes a
// few milliseconds; a loaded 2-core runner can leave a goroutine waiting
// longer) reads as an "extra" message that was never published. So each
// message reaches the suite no sooner than reconnectRecordLag after the
// subscription handed it out, in order; with reconnectInFlight messages
// out at once the drain still runs at thousands per second.
const (
	reconnectRecordLag = 50 * time.Millisecond
	reconnectInFlight  = 100
)

// recordedFirst is a message.Subscriber whose channels hand each message on
// no sooner than after the moment the subscription handed it out.
type recordedFirst struct {
	message.Subscriber
	after time.Duration
}

func (r *recordedFirst) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := r.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	type timed struct {
		msg *message.Message
		at  time.Time
	}
	// Deeper than the messages out at once: reading in never waits.
	queue := make(chan timed, 2*reconnectInFlight)
	out := make(chan *message.Message)
	go func() {
		defer close(queue)
		for msg := range in {
			queue <- timed{msg, time.Now()}
		}
	}()
	go func() {
		defer close(out)
		for m := range queue {
			time.Sleep(time.Until(m.at.Add(r.after)))
			select {
			case out <- m.msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}
