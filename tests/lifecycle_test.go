package tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Close waits for an in-flight message's verdict (within DrainTimeout) and
// writes it before returning.
func TestCloseWaitsForInFlightAck(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.DrainTimeout = time.Minute })
	b.publishInTx(t, "t", true, newMsg("x"))
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)

	closed := make(chan error, 1)
	go func() { closed <- sub.Close() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a message was in flight and the drain time not over")
	case <-time.After(300 * time.Millisecond):
	}
	m.Ack()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the ack")
	}
	require.Equal(t, 0, b.outboxRows(t, "t"), "the ack must be written before Close returns")
	_, ok := <-ch
	require.False(t, ok, "the output channel must be closed")
}

// Ending one subscription's context ends that subscription only.
func TestCancelEndsOneSubscriptionOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, nil)
	ctxA, cancelA := context.WithCancel(context.Background())
	chA, err := sub.Subscribe(ctxA, "a")
	require.NoError(t, err)
	chB, err := sub.Subscribe(context.Background(), "b")
	require.NoError(t, err)

	cancelA()
	select {
	case _, ok := <-chA:
		require.False(t, ok)
	case <-time.After(10 * time.Second):
		t.Fatal("cancelled subscription's channel not closed")
	}
	b.publishInTx(t, "b", true, newMsg("still here"))
	m := receive(t, chB, 10*time.Second)
	require.Equal(t, "still here", string(m.Payload))
	m.Ack()

	// And the Subscriber takes new subscriptions.
	chA2, err := sub.Subscribe(context.Background(), "a")
	require.NoError(t, err)
	b.publishInTx(t, "a", true, newMsg("again"))
	receive(t, chA2, 10*time.Second).Ack()
}

// MaxInFlight bounds what a subscription holds: handed-out messages and
// leased rows alike.
func TestMaxInFlightBoundsLeasedRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msgs := newMsgs(10)
	b.publishInTx(t, "t", true, msgs...)
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.MaxInFlight = 3 })
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)

	var got []*message.Message
	for range 3 {
		got = append(got, receive(t, ch, 10*time.Second))
	}
	requireNothing(t, ch, 300*time.Millisecond)
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL`))

	got[0].Ack()
	got = append(got, receive(t, ch, 10*time.Second))
	for _, m := range got[1:] {
		m.Ack()
	}
	for range 6 {
		receive(t, ch, 10*time.Second).Ack()
	}
}

// With MaxInFlight 1 the next message waits for the previous verdict and
// messages arrive in publish order, across Publish calls.
func TestSingleInFlightKeepsPublishOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i := range 20 {
		b.publishInTx(t, "t", true, newMsg(fmt.Sprint(2*i)), newMsg(fmt.Sprint(2*i+1)))
	}
	sub := b.subscriber(t, nil)
	ch, err := sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
	for i := range 40 {
		m := receive(t, ch, 10*time.Second)
		require.Equal(t, fmt.Sprint(i), string(m.Payload))
		m.Ack()
	}
}
