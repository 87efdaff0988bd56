package notifier

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// dispatch routes every payload the SQL statements send (query.Publish,
// query.Complete) to the right waiters with the right kind.
func TestDispatchRoutesByTopicAndGroup(t *testing.T) {
	n := &Notifier{waiters: map[string]map[string]map[*Waiter]struct{}{}}
	a := n.Listen("ch", "orders", "billing")
	b := n.Listen("ch", "orders", "shipping")
	other := n.Listen("ch", "refunds", "billing")
	took := func(w *Waiter) Kinds {
		select {
		case <-w.C:
		default:
		}
		return w.Take()
	}

	n.dispatch("ch", "orders") // a publisher: rows due, every group
	require.Equal(t, Kinds{Due: true}, took(a))
	require.Equal(t, Kinds{Due: true}, took(b))
	require.Equal(t, Kinds{}, took(other))

	n.dispatch("ch", query.ScheduleMark+"orders") // a publisher: rows due later
	require.Equal(t, Kinds{Scheduled: true}, took(a))
	require.Equal(t, Kinds{Scheduled: true}, took(b))

	n.dispatch("ch", query.GroupMark+"orders"+query.GroupMark+"billing") // billing returned rows due now
	require.Equal(t, Kinds{Released: true}, took(a))
	require.Equal(t, Kinds{}, took(b), "another group's rows do not wake shipping")
	require.Equal(t, Kinds{}, took(other))

	n.dispatch("ch", query.ScheduleMark+"orders"+query.GroupMark+"shipping") // shipping nacked with a delay
	require.Equal(t, Kinds{}, took(a))
	require.Equal(t, Kinds{Scheduled: true}, took(b))

	n.dispatch("ch", query.GroupMark+"orders"+query.GroupMark) // the default group
	require.Equal(t, Kinds{}, took(a))
	require.Equal(t, Kinds{}, took(b))
	def := n.Listen("ch", "orders", "")
	n.dispatch("ch", query.GroupMark+"orders"+query.GroupMark)
	require.Equal(t, Kinds{Released: true}, took(def))

	n.dispatch("other-channel", "orders")
	require.Equal(t, Kinds{}, took(a), "another outbox's channel")
}
