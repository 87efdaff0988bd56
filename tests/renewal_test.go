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
// delivered exactly once. The handler holds the message until it has seen
// its lease renewed six times (every Lease/2: three leases' worth) and at
// least three leases have passed; nothing here bounds how fast that goes.
func TestSlowHandlerIsDeliveredOnceThanksToRenewal(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// Renewals come every Lease/2 and each leaves Lease/2 of slack: a lease
	// of a few seconds stands scheduling stalls on a loaded machine.
	const (
		lease    = 3 * time.Second
		renewals = 6
	)
	short := func(ev *events) func(c *pgoutbox.SubscriberConfig) {
		return func(c *pgoutbox.SubscriberConfig) {
			c.Lease = lease
			c.MinPollInterval = 20 * time.Millisecond
			c.MaxPollInterval = 200 * time.Millisecond
			c.Observer = ev
		}
	}
	evA, evB := newEvents(), newEvents()
	subA := b.subscriber(t, short(evA))
	subB := b.subscriber(t, short(evB))
	b.publishInTx(t, "slow", true, newMsg("x"))

	var deliveries atomic.Int32
	chA, err := subA.Subscribe(context.Background(), "slow")
	require.NoError(t, err)
	m := receive(t, chA, 10*time.Second)
	deliveries.Add(1)
	start := time.Now()
	// Only now does B start competing, while A's handler runs.
	runRouter(t, subB, "slow", func(*message.Message) error {
		deliveries.Add(1)
		return nil
	})

	// The slow handler's work: it lasts until A renewed the lease enough
	// times to outlive three leases.
	seen := 0
	for seen < renewals || time.Since(start) < 3*lease {
		if e := evA.wait(t, pgoutbox.EventLeaseRenewed, 10*lease); e.Count > 0 {
			seen++
		}
		require.Zero(t, evA.countKind(pgoutbox.EventLeaseLost), "A lost its lease while its handler ran")
		require.Equal(t, int32(1), deliveries.Load(), "B got the message while A's handler held it")
	}
	select {
	case <-m.Context().Done():
		t.Fatal("the held message's context ended while its handler ran")
	default:
	}
	m.Ack()
	evA.wait(t, pgoutbox.EventAcked, 30*time.Second)
	require.Equal(t, int32(1), deliveries.Load())
	require.GreaterOrEqual(t, seen, renewals, "renewed every Lease/2")
	require.Zero(t, evA.countKind(pgoutbox.EventLeaseLost))
	require.Equal(t, 0, b.outboxRows(t, "slow"))
}
