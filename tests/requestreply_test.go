package tests

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/components/requestreply"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Watermill's request/reply (components/requestreply) as docs/consumer-
// groups.md sets it up: a reply topic per operation, read by one shared
// subscriber, unbound (with what is left in it) once the operation has
// its reply. Concurrent requests each get their own reply (a failed
// command its error), and nothing of them stays behind: no binding, no
// row. A failed command is acked (AckCommandErrors): nacked, it would be
// delivered again and each attempt would publish another reply into a
// topic nobody reads any more.
func TestRequestReplyWithATopicPerOperation(t *testing.T) {
	t.Parallel()
	b := setup(t, pgoutboxtest.Options{MaxConns: 20})
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	pub, err := pgoutbox.NewContextPublisher(exec, pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	replies := b.subscriber(t, nil) // shared by every waiting request
	commands := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = "book_room"; c.MaxInFlight = 8 })

	replyTopic := func(op requestreply.OperationID) string { return "reply." + string(op) }
	// The unbinds run after each reply reached its request: the test
	// waits for them all to return (the pool closes when it ends).
	var unbinds sync.WaitGroup
	timeout := 20 * time.Second
	backend, err := requestreply.NewPubSubBackend[string](requestreply.PubSubBackendConfig{
		Publisher: pub,
		SubscriberConstructor: func(requestreply.PubSubBackendSubscribeParams) (message.Subscriber, error) {
			return replies, nil
		},
		GenerateSubscribeTopic: func(p requestreply.PubSubBackendSubscribeParams) (string, error) {
			return replyTopic(p.OperationID), nil
		},
		GeneratePublishTopic: func(p requestreply.PubSubBackendPublishParams) (string, error) { return replyTopic(p.OperationID), nil },
		OnListenForReplyFinished: func(ctx context.Context, p requestreply.PubSubBackendSubscribeParams) {
			defer unbinds.Done()
			_, err := pgoutbox.Unbind(context.WithoutCancel(ctx), exec, b.tables, replyTopic(p.OperationID), "", true)
			if err != nil {
				t.Errorf("unbind the reply topic: %v", err)
			}
		},
		ListenForReplyTimeout: &timeout,
		AckCommandErrors:      true,
	}, requestreply.BackendPubsubJSONMarshaler[string]{})
	require.NoError(t, err)

	marshaler := cqrs.JSONMarshaler{}
	bus, err := cqrs.NewCommandBusWithConfig(pub, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return "commands.book_room", nil },
		Marshaler:            marshaler,
	})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	processor, err := cqrs.NewCommandProcessorWithConfig(r, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return "commands.book_room", nil
		},
		SubscriberConstructor: func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return commands, nil
		},
		Marshaler: marshaler,
	})
	require.NoError(t, err)
	require.NoError(t, processor.AddHandlers(requestreply.NewCommandHandlerWithResult[bookRoom, string]("book_room", backend,
		func(_ context.Context, c *bookRoom) (string, error) {
			if n, _ := strconv.Atoi(c.Room); n%4 == 3 {
				return "", fmt.Errorf("room %s is taken", c.Room)
			}
			return "booked " + c.Room, nil
		})))
	startRouter(t, r)

	const requests = 10
	var wg sync.WaitGroup
	got := make([]string, requests)
	unbinds.Add(requests)
	for i := range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reply, err := requestreply.SendWithReply[string](ctx, bus, backend, &bookRoom{Room: fmt.Sprint(i)})
			switch {
			case err != nil:
				t.Errorf("request %d: %v", i, err)
			case reply.Error != nil:
				got[i] = reply.Error.Error()
			default:
				got[i] = reply.HandlerResult
			}
		}()
	}
	wg.Wait()
	unbinds.Wait()
	for i, g := range got {
		if i%4 == 3 {
			require.Contains(t, g, fmt.Sprintf("room %d is taken", i), "request %d has its own error", i)
			continue
		}
		require.Equal(t, fmt.Sprint("booked ", i), g, "request %d has its own reply", i)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_bindings WHERE topic LIKE 'reply.%'`), "no reply topic stays bound")
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE topic LIKE 'reply.%'`), "no reply stays behind")
}
