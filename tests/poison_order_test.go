package tests

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// poisonUnlessKeyed applies a PoisonQueue middleware to unkeyed messages
// only. PoisonQueue acks the message it poisons, so its key would move on
// at once; a keyed message that fails every attempt is nacked instead and
// keeps its key waiting for as long as the RetryPolicy retries it.
func poisonUnlessKeyed(poisonQueue message.HandlerMiddleware) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		poisoning := poisonQueue(h)
		return func(msg *message.Message) ([]*message.Message, error) {
			if msg.Metadata.Get(pgoutbox.OrderingKeyMetadataKey) != "" {
				return h(msg)
			}
			return poisoning(msg)
		}
	}
}

// With the README's stack, PoisonQueue lets a failing keyed message's key
// move on once Retry's attempts are spent (docs/ordering.md says so); with
// keyed messages kept out of it and a RetryPolicy that retries forever,
// the key waits until the handler is fixed, and then runs in publish order.
func TestPoisonQueueAndOrderingKeys(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		for _, keyedOut := range []bool{false, true} {
			name := map[bool]string{false: "poison_queue_on_every_message", true: "keyed_messages_kept_out"}[keyedOut]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				pub := b.poolPublisher(t)
				keyed := func(name string) *message.Message {
					m := newMsg(name)
					pgoutbox.WithOrderingKey(m, "account-1")
					return m
				}
				other := newMsg("q1")
				pgoutbox.WithOrderingKey(other, "account-2")
				require.NoError(t, pub.Publish("payments", keyed("p1"), keyed("p2"), newMsg("u1"), keyed("p3"), other))
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = 4
					// The docs' policy, its intervals shortened for the test.
					c.RetryPolicy = pgoutbox.ExponentialBackoff{InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond, MaxAttempts: pgoutbox.RetryForever}
				})
				poisonQueue, err := middleware.PoisonQueue(pub, "payments.poison")
				require.NoError(t, err)
				if keyedOut {
					poisonQueue = poisonUnlessKeyed(poisonQueue)
				}
				var broken atomic.Bool
				broken.Store(true)
				var p1Failures atomic.Int32
				var mu sync.Mutex
				var handled []string
				runRouter(t, sub, "payments", func(m *message.Message) error {
					if p := string(m.Payload); p == "u1" || (p == "p1" && broken.Load()) {
						if p == "p1" {
							p1Failures.Add(1)
						}
						return errors.New("bug")
					}
					mu.Lock()
					handled = append(handled, string(m.Payload))
					mu.Unlock()
					return nil
				}, pgoutbox.ErrorRecorder, poisonQueue, middleware.Retry{MaxRetries: 1}.Middleware)
				done := func(n int) func() bool {
					return func() bool {
						mu.Lock()
						defer mu.Unlock()
						return len(handled) == n
					}
				}
				if !keyedOut {
					// p1 poisoned after two attempts, and the key moved on.
					pollUntil(t, "p2, p3 and q1 handled while p1 is broken", 10*time.Second, nil, done(3))
					mu.Lock()
					require.Equal(t, []string{"p2", "p3"}, slices.DeleteFunc(slices.Clone(handled), func(s string) bool { return s == "q1" }))
					mu.Unlock()
					pollUntil(t, "p1 and u1 poisoned", 10*time.Second, nil, func() bool { return b.outboxRows(t, "payments.poison") == 2 })
					return
				}
				// Eight failed attempts (four deliveries of Retry's two)
				// while the key waits behind p1.
				pollUntil(t, "p1 retried", 10*time.Second, nil, func() bool { return p1Failures.Load() >= 8 })
				pollUntil(t, "u1 poisoned", 10*time.Second, nil, func() bool { return b.outboxRows(t, "payments.poison") == 1 })
				pollUntil(t, "the other key handled", 10*time.Second, nil, done(1))
				mu.Lock()
				require.Equal(t, []string{"q1"}, handled, "nothing of account-1 ran while p1 failed; account-2 did")
				mu.Unlock()
				broken.Store(false)
				pollUntil(t, "the key handled once p1 was fixed", 10*time.Second, nil, done(4))
				mu.Lock()
				defer mu.Unlock()
				require.Equal(t, []string{"q1", "p1", "p2", "p3"}, handled)
			})
		}
	})
}
