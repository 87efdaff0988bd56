package tests

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// With a 10s poll interval, only the NOTIFY sent at commit can deliver a
// message to an idle subscriber within 2s.
func TestIdleSubscriberIsWokenByNotify(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := newEvents()
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
		c.MinPollInterval = 10 * time.Second
		c.MaxPollInterval = 10 * time.Second
		c.Lease = 30 * time.Second
		c.Observer = ev
	})
	ch, err := sub.Subscribe(context.Background(), "wake")
	require.NoError(t, err)
	// The first claim finds nothing: the loop is now asleep for ~10s.
	require.Zero(t, ev.wait(t, pgoutbox.EventClaimed, 10*time.Second).Count)

	start := time.Now()
	b.publishInTx(t, "wake", true, newMsg("hello"))
	m := receive(t, ch, 10*time.Second)
	elapsed := time.Since(start)
	m.Ack()
	require.Less(t, elapsed, 2*time.Second, "a committed message must wake the idle subscriber, not wait for the poll")
}

// A NOTIFY wakes only the loops of its topic. (Subscribers of one pool share
// one LISTEN connection; a loop is also woken once when that connection is
// established, since it may have missed a notification before.)
func TestNotifyWakesOnlyItsTopic(t *testing.T) {
	t.Parallel()
	b := setup(t)
	evA, evB := newEvents(), newEvents()
	idle := func(ev *events) func(c *pgoutbox.SubscriberConfig) {
		return func(c *pgoutbox.SubscriberConfig) {
			c.MinPollInterval, c.MaxPollInterval, c.Lease = 10*time.Second, 10*time.Second, 30*time.Second
			c.Observer = ev
		}
	}
	subA := b.subscriber(t, idle(evA))
	chA, err := subA.Subscribe(context.Background(), "a")
	require.NoError(t, err)
	// Once a message arrives through NOTIFY, the shared LISTEN connection
	// is up, so B below registers on a live connection.
	b.publishInTx(t, "a", true, newMsg("first"))
	receive(t, chA, 2*time.Second).Ack()

	subB := b.subscriber(t, idle(evB))
	_, err = subB.Subscribe(context.Background(), "b")
	require.NoError(t, err)
	require.Zero(t, evB.wait(t, pgoutbox.EventClaimed, 10*time.Second).Count)

	b.publishInTx(t, "a", true, newMsg("second"))
	receive(t, chA, 2*time.Second).Ack()
	evA.wait(t, pgoutbox.EventAcked, 10*time.Second) // first
	evA.wait(t, pgoutbox.EventAcked, 10*time.Second) // second
	require.Equal(t, 1, evB.countKind(pgoutbox.EventClaimed), "topic b's loop must stay asleep")
}
