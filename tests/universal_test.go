package tests

import (
	"context"
	"os"
	"sync"
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
		rec := &publishRecord{returned: map[string]time.Time{}, changed: make(chan struct{})}
		return &publishedRecorder{Publisher: pub, record: rec}, &recordedFirst{Subscriber: sub, record: rec, after: reconnectRecordLag}
	}
	tests.TestReconnect(t, tests.TestContext{TestID: tests.NewTestID(), Features: features}, construct)
}

// The suite's reconnect case records a message as published on a goroutine
// of its own, fed by a channel after Publish returned nil, and compares the
// record with what was received as soon as the last message arrives. Two
// kinds of delivery read as an "extra" message that was never published:
// one quicker than that goroutine's next turn (a loaded 2-core runner can
// leave it waiting), and one of a Publish that failed as the server went
// down after its row was written (the suite retries it later, 500 ms
// apart, and records it only then). So each message reaches the suite no
// sooner than reconnectRecordLag after a Publish of it returned nil; with
// reconnectInFlight messages out at once the drain still runs at thousands
// per second.
const (
	reconnectRecordLag = 50 * time.Millisecond
	reconnectInFlight  = 100
)

// publishRecord holds when a Publish of each message UUID last returned nil.
type publishRecord struct {
	mu       sync.Mutex
	returned map[string]time.Time
	changed  chan struct{} // closed and replaced on every record
}

func (r *publishRecord) add(msgs []*message.Message) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		r.returned[m.UUID] = now
	}
	close(r.changed)
	r.changed = make(chan struct{})
}

// wait returns when a Publish of uuid returned nil, false when ctx ends first.
func (r *publishRecord) wait(ctx context.Context, uuid string) (time.Time, bool) {
	for {
		r.mu.Lock()
		at, ok := r.returned[uuid]
		changed := r.changed
		r.mu.Unlock()
		if ok {
			return at, true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return time.Time{}, false
		}
	}
}

// publishedRecorder notes each Publish that returned nil.
type publishedRecorder struct {
	message.Publisher
	record *publishRecord
}

func (p *publishedRecorder) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.record.add(msgs)
	return nil
}

// recordedFirst is a message.Subscriber whose channels hand each message on,
// in order, no sooner than after a Publish of it returned nil.
type recordedFirst struct {
	message.Subscriber
	record *publishRecord
	after  time.Duration
}

func (r *recordedFirst) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := r.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	// Deeper than the messages out at once: reading in never waits.
	queue := make(chan *message.Message, 2*reconnectInFlight)
	out := make(chan *message.Message)
	go func() {
		defer close(queue)
		for msg := range in {
			queue <- msg
		}
	}()
	go func() {
		defer close(out)
		for msg := range queue {
			published, ok := r.record.wait(ctx, msg.UUID)
			if !ok {
				return
			}
			time.Sleep(time.Until(published.Add(r.after)))
			select {
			case out <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}
