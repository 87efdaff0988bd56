package pgoutboxtest_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// newShippingRouter is the code under test: a router whose handler turns
// every placed order into a shipping request. In production it gets a Kafka
// subscriber and publisher; it only knows Watermill's interfaces.
func newShippingRouter(sub message.Subscriber, pub message.Publisher) (*message.Router, error) {
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	router.AddHandler("ship", "orders.placed", sub, "shipping.requested", pub,
		func(msg *message.Message) ([]*message.Message, error) {
			out := message.NewMessage(watermill.NewUUID(), []byte("ship "+strings.ToUpper(string(msg.Payload))))
			out.Metadata.Set("order_uuid", msg.UUID)
			return []*message.Message{out}, nil
		})
	return router, nil
}

// testShippingHandler is the handler's test: pgoutbox's publisher and
// subscriber stand in for Kafka's, on an outbox of the test's own.
func testShippingHandler(t testing.TB) {
	env := pgoutboxtest.PubSub(t)
	router, err := newShippingRouter(env.Subscriber, env.Publisher)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { cancel(); _ = router.Close() }) // runs before env's cleanup
	<-router.Running()

	order := message.NewMessage(watermill.NewUUID(), []byte("book"))
	require.NoError(t, env.Publisher.Publish("orders.placed", order))

	got := env.Drain(t, "shipping.requested", 1, 30*time.Second)
	require.Equal(t, order.UUID, got[0].Metadata.Get("order_uuid"))
	fmt.Println(string(got[0].Payload))
}

// Example_handlerTest tests a Watermill router's handler with pgoutbox in
// place of the Kafka publisher and subscriber it runs with in production.
func Example_handlerTest() {
	runTest(testShippingHandler) // in your code: func TestShippingHandler(t *testing.T)
	// Output:
	// ship BOOK
}
