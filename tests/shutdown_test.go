package tests

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Router.Close cancels the context it gave Subscribe. Handlers in flight
// keep a live message context through the drain, finish, and their acks
// are written before the Router's Close returns; the messages no handler
// had are given back.
func TestRouterCloseLetsInFlightHandlersFinish(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 4} {
		t.Run("max_in_flight="+map[int]string{1: "1", 4: "4"}[inFlight], func(t *testing.T) {
			t.Parallel()
			onEachClaimPath(t, func(t *testing.T, path string) {
				b := setup(t)
				require.NoError(t, b.poolPublisher(t).Publish("t", newMsgs(8)...))
				sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
					onPath(t, path, c)
					c.MaxInFlight = inFlight
					c.DrainTimeout = 20 * time.Second
				})
				started := make(chan struct{}, 8)
				release := make(chan struct{})
				var finished, cancelled atomic.Int32
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, watermill.NopLogger{})
				require.NoError(t, err)
				spy := &subscribeSpy{Subscriber: sub, ctx: make(chan context.Context, 1)}
				r.AddConsumerHandler("h", "t", spy, func(m *message.Message) error {
					started <- struct{}{}
					select {
					case <-release:
						finished.Add(1)
						return nil
					case <-m.Context().Done():
						cancelled.Add(1)
						return m.Context().Err()
					}
				})
				done := make(chan error, 1)
				go func() { done <- r.Run(context.Background()) }()
				<-r.Running()
				for range inFlight {
					<-started
				}
				closed := make(chan error, 1)
				go func() { closed <- r.Close() }()
				subCtx := <-spy.ctx
				select {
				case <-subCtx.Done(): // the Router is closing; the handlers still run
				case <-time.After(10 * time.Second):
					t.Fatal("the Router did not cancel the Subscribe context")
				}
				close(release)
				require.NoError(t, <-closed)
				require.NoError(t, <-done)
				require.Zero(t, cancelled.Load(), "no handler saw its context cancelled")
				require.Equal(t, int32(inFlight), finished.Load())
				require.Equal(t, 8-inFlight, b.outboxRows(t, "t"), "the finished messages were acked, the rest given back")
			})
		})
	}
}

// subscribeSpy hands over the context a Router subscribes with.
type subscribeSpy struct {
	message.Subscriber
	ctx chan context.Context
}

func (s *subscribeSpy) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.ctx <- ctx
	return s.Subscriber.Subscribe(ctx, topic)
}
