package notifier

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
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

// A key counts as gone once OrphanChecks checks in a row missed it, and
// not before; this process's own keys never do. Until OrphanChecks checks
// were made, no key is known gone.
func TestLockChecksNeedEveryLastCheckToMissAKey(t *testing.T) {
	own := map[int64]bool{9: true}
	var c lockChecks
	held := func(keys ...int64) map[int64]bool {
		m := map[int64]bool{}
		for _, k := range keys {
			m[k] = true
		}
		return m
	}
	gone, vanished := c.add(held(1, 2, 9), own)
	require.False(t, gone || vanished)
	_, ok := c.spare(own)
	require.False(t, ok, "one check cannot tell a dead holder from a reconnecting one")

	gone, vanished = c.add(held(1, 9), own) // 2 missing once
	require.False(t, gone)
	require.True(t, vanished)
	gone, _ = c.add(held(1, 2), own) // 2 back (a blip); 9 missing, but it is ours
	require.False(t, gone)
	keys, ok := c.spare(own)
	require.True(t, ok)
	require.ElementsMatch(t, []int64{1, 2, 9}, keys)

	gone, vanished = c.add(held(2), own) // 1 missing: once
	require.False(t, gone)
	require.True(t, vanished)
	gone, vanished = c.add(held(2), own) // twice
	require.False(t, gone)
	require.False(t, vanished)
	keys, _ = c.spare(own)
	require.Contains(t, keys, int64(1), "missing from two checks only: spared")
	gone, _ = c.add(held(2), own) // three times
	require.True(t, gone)
	keys, _ = c.spare(own)
	require.ElementsMatch(t, []int64{2, 9}, keys)
	gone, _ = c.add(held(2), own) // still missing: gone was said once
	require.False(t, gone)
}

// The process counts its own lock as held only for OwnLockValidFor after
// the check that confirmed it, and wakes its subscriptions with LockLost
// when that runs out, before the other processes' checks could take its
// rows.
func TestOwnLockCountsAsHeldOnlyWhileConfirmed(t *testing.T) {
	require.Less(t, LivenessEvery, OwnLockValidFor, "a check a period later must confirm it in time")
	require.Less(t, OwnLockValidFor, time.Duration(OrphanChecks-1)*LivenessEvery, "the others take the rows no sooner than this after the last confirmation")

	n := &Notifier{waiters: map[string]map[string]map[*Waiter]struct{}{}, logger: watermill.NopLogger{}}
	w := n.Listen("ch", "orders", "")
	lapse := time.AfterFunc(time.Hour, n.lapsed)
	defer lapse.Stop()
	n.setLiveness(7, true)
	n.confirmed(time.Now(), lapse)
	key, live := n.Liveness()
	require.Equal(t, int64(7), key)
	require.True(t, live)

	select {
	case <-w.C:
	case <-time.After(10 * OwnLockValidFor):
		t.Fatal("no wake-up when the confirmation ran out")
	}
	require.True(t, w.Take().LockLost)
	key, live = n.Liveness()
	require.Equal(t, int64(7), key, "the key stays: rows are stamped with it again once a check confirms it")
	require.False(t, live)

	n.confirmed(time.Now(), lapse)
	_, live = n.Liveness()
	require.True(t, live)
	n.confirmed(time.Now().Add(-OwnLockValidFor), lapse) // a check sent that long ago
	_, live = n.Liveness()
	require.False(t, live)
}
