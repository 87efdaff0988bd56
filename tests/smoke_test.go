package tests

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSmoke(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, nil)
	_ = ev
	pub := b.poolPublisher(t)
	require.NoError(t, pub.Publish("orders", newMsg("a"), newMsg("b")))
	ch, err := sub.Subscribe(context.Background(), "orders")
	require.NoError(t, err)
	m := receive(t, ch, 5*time.Second)
	require.Equal(t, "a", string(m.Payload))
	m.Ack()
	m = receive(t, ch, 5*time.Second)
	require.Equal(t, "b", string(m.Payload))
	m.Nack()
	m = receive(t, ch, 5*time.Second)
	require.Equal(t, "b", string(m.Payload))
	m.Ack()
	require.NoError(t, sub.Close())
	require.Equal(t, 0, b.outboxRows(t, "orders"))
}
