package tests

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// A handler running three times longer than the lease, with a second
// subscriber waiting for the row: renewal keeps the lease, so the message is
// delivered exactly once.
func TestSlowHandlerIsDeliveredOnceThanksToRenewal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const lease = 2 * time.Second
	short := func(ev *events) func(c *pgoutbox.SubscriberConfig) {
		return func(c *pgoutbox.SubscriberConfig) {
			c.Lease = lease
			c.MinPollInterval = 20 * time.Millisecond
			c.MaxPollInterval = 200 * time.Millisecond
			c.StatementTimeout = 500 * time.Millisecond
			c.Observer = ev
		}
	}
	evA, evB := newEvents(), newEvents()
	subA := b.subscriber(t, short(evA))
	subB := b.subscriber(t, short(evB))
	b.publishInTx(t, "slow", true, newMsg("x"))

	var deliveries atomic.Int32
	done := make(chan struct{})
	chA, err := subA.Subscribe(context.Background(), "slow")
	require.NoError(t, err)
	m := receive(t, chA, 10*time.Second)
	deliveries.Add(1)
	// Only now does B start competing, while A's handler runs.
	runRouter(t, subB, "slow", func(*message.Message) error {
		deliveries.Add(1)
		return nil
	})
	go func() {
		defer close(done)
		time.Sleep(3 * lease) // the slow handler's work
		m.Ack()
	}()
	<-done
	evA.wait(t, pgoutbox.EventAcked, 10*time.Second)
	require.Equal(t, int32(1), deliveries.Load())
	require.GreaterOrEqual(t, evA.countKind(pgoutbox.EventLeaseRenewed), 4, "renewed every Lease/2")
	require.Zero(t, evA.countKind(pgoutbox.EventLeaseLost))
	require.Equal(t, 0, b.outboxRows(t, "slow"))
}
