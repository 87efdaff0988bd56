package notifier

import (
	"context"
	"sync/atomic"
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

	n.dispatch("ch", query.ArrivalMark+"orders") // a publisher: arrivals, due now
	require.Equal(t, Kinds{Due: true, Arrived: true}, took(a))
	require.Equal(t, Kinds{Due: true, Arrived: true}, took(b))
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

// A key counts as gone once it stayed missing for OrphanGrace from the
// end of the check that first missed it, however close together the
// checks ran (a reconnecting session checks at once), and not before;
// this process's own keys never do. Until the checks have watched the
// locks for OrphanGrace, no key is known gone.
func TestLockChecksCountAKeyGoneAfterTheGrace(t *testing.T) {
	own := map[int64]bool{9: true}
	var c lockChecks
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	held := func(keys ...int64) map[int64]bool {
		m := map[int64]bool{}
		for _, k := range keys {
			m[k] = true
		}
		return m
	}
	gone, vanished := c.add(at(0), held(1, 2, 9), own)
	require.False(t, gone || vanished)
	_, ok := c.spare(at(OrphanGrace/2), own)
	require.False(t, ok, "too soon to tell a dead holder from a reconnecting one")

	gone, vanished = c.add(at(500*time.Millisecond), held(1, 9), own) // 2 missing
	require.False(t, gone)
	require.True(t, vanished)
	gone, _ = c.add(at(time.Second), held(1, 2), own) // 2 back (a blip); 9 missing, but it is ours
	require.False(t, gone)
	keys, ok := c.spare(at(time.Second), own)
	require.True(t, ok)
	require.ElementsMatch(t, []int64{1, 2, 9}, keys)

	// 1 goes missing; checks then come close together (a reconnect).
	gone, vanished = c.add(at(1500*time.Millisecond), held(2), own)
	require.False(t, gone)
	require.True(t, vanished)
	for _, d := range []time.Duration{1650, 1800, 1950, 2400} {
		gone, vanished = c.add(at(d*time.Millisecond), held(2), own)
		require.False(t, gone, "at %v: missing for less than the grace", d)
		require.False(t, vanished)
	}
	keys, _ = c.spare(at(2400*time.Millisecond), own)
	require.Contains(t, keys, int64(1), "missing for 900 ms: spared")
	keys, _ = c.spare(at(2500*time.Millisecond), own)
	require.NotContains(t, keys, int64(1), "missing for the grace: a claim takes its rows")
	gone, _ = c.add(at(2600*time.Millisecond), held(2), own)
	require.True(t, gone)
	gone, _ = c.add(at(3100*time.Millisecond), held(2), own) // still missing: gone was said once
	require.False(t, gone)
	keys, _ = c.spare(at(3100*time.Millisecond), own)
	require.ElementsMatch(t, []int64{2, 9}, keys)
}

// A key counts as missing only while this process's checks watched: a gap
// in its own checks longer than KeyShownAfter (its connection stalled)
// starts the count again, since the key's holder may have taken it again
// and stamped rows meanwhile, unseen (a process back from a stall took a
// live process's rows at once); and while the checks are that late, no key
// is known gone.
func TestLockChecksCountNothingAcrossAGapOfTheirOwn(t *testing.T) {
	own := map[int64]bool{}
	var c lockChecks
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	c.add(at(0), map[int64]bool{1: true}, own)
	c.add(at(500*time.Millisecond), map[int64]bool{}, own) // 1 missing from here
	c.add(at(time.Second), map[int64]bool{}, own)
	keys, ok := c.spare(at(1200*time.Millisecond), own)
	require.True(t, ok)
	require.Contains(t, keys, int64(1), "missing for 700 ms: spared")
	_, ok = c.spare(at(2*time.Second), own)
	require.False(t, ok, "no check for a second: not watching")
	gone, _ := c.add(at(2200*time.Millisecond), map[int64]bool{}, own) // after a stall of 1.2 s
	require.False(t, gone, "missing for 1.7 s, but not watched for 1.2 s of it")
	_, ok = c.spare(at(2300*time.Millisecond), own)
	require.False(t, ok, "the checks start over")
	for _, d := range []time.Duration{2700, 3000} {
		gone, _ = c.add(at(d*time.Millisecond), map[int64]bool{}, own)
		require.False(t, gone, "at %v", d)
	}
	gone, _ = c.add(at(3200*time.Millisecond), map[int64]bool{}, own)
	require.True(t, gone, "watched missing for the grace since the stall")
	keys, ok = c.spare(at(3300*time.Millisecond), own)
	require.True(t, ok)
	require.NotContains(t, keys, int64(1))
}

// The process counts its own lock as held only for OwnLockValidFor after
// the check that confirmed it was sent, and wakes its subscriptions when
// that runs out, before the other processes could take its rows, and
// again when a check confirms it after that.
func TestOwnLockCountsAsHeldOnlyWhileConfirmed(t *testing.T) {
	require.Less(t, LivenessEvery, OwnLockValidFor, "the next check must confirm it in time")
	require.Less(t, OwnLockValidFor, OrphanGrace, "the others take the rows no sooner than OrphanGrace after the lock went, so after the last confirmation")

	n := &Notifier{waiters: map[string]map[string]map[*Waiter]struct{}{}, logger: watermill.NopLogger{}}
	w := n.Listen("ch", "orders", "")
	took := func() Kinds {
		select {
		case <-w.C:
		default:
		}
		return w.Take()
	}
	lapse := time.AfterFunc(time.Hour, func() { n.lapsed() })
	defer lapse.Stop()
	shown := func() {
		t.Helper()
		_, live := n.Liveness()
		require.False(t, live, "taken, not yet seen by the others: rows carry no key")
		// Checks confirm the lock meanwhile, as the session's do.
		checks := time.NewTicker(LivenessEvery / 5)
		defer checks.Stop()
		deadline := time.After(10 * KeyShownAfter)
		for woken := false; !woken; {
			select {
			case <-w.C:
				woken = true
			case <-checks.C:
				n.confirmed(7, time.Now(), lapse)
			case <-deadline:
				t.Fatal("no wake-up once the others saw the key")
			}
		}
		require.True(t, w.Take().LockChanged, "the others have seen the lock: rows can carry it")
	}
	n.confirmed(7, time.Now(), lapse)
	shown()
	key, live := n.Liveness()
	require.Equal(t, int64(7), key)
	require.True(t, live)
	n.confirmed(7, time.Now(), lapse)
	require.False(t, took().LockChanged, "confirmed while live: nothing changed")

	select {
	case <-w.C:
	case <-time.After(10 * OwnLockValidFor):
		t.Fatal("no wake-up when the confirmation ran out")
	}
	require.True(t, w.Take().LockChanged)
	key, live = n.Liveness()
	require.Equal(t, int64(7), key, "the key stays: rows are stamped with it again once a check confirms it")
	require.False(t, live)

	n.confirmed(7, time.Now(), lapse)
	shown() // confirmed again after the lapse: rows get the key back once the others saw it
	_, live = n.Liveness()
	require.True(t, live)
	n.confirmed(7, time.Now().Add(-OwnLockValidFor), lapse) // a check sent that long ago
	_, live = n.Liveness()
	require.False(t, live)
}

// A lapse probes the lock, one probe at a time. A probe that found it
// held probes again OwnLockValidFor later unless a check answered
// meanwhile (the path may be silent, and only a confirmation arms the lapse
// timer again); probes pause after slowStreak in a row with checks
// answered between them (a slow path). A probe that took the lock ends the
// session and hands its connection over; none starts once the session took
// the result.
func TestLockProbeRetriesASilentPathPausesASlowOneAndHandsItsConnectionOver(t *testing.T) {
	tries := make(chan int64, 10)
	answer := make(chan *lockedConn)
	settled := make(chan struct{}, 10)
	var answeredAt, later atomic.Int64
	ctx, end := context.WithCancelCause(context.Background())
	p := newLockProbe(ctx, end,
		func(_ context.Context, key int64) *lockedConn { tries <- key; return <-answer },
		func() time.Time { return time.Unix(0, answeredAt.Load()) },
		func() time.Time { return time.Now().Add(time.Duration(later.Load())) },
		func() { settled <- struct{}{} })
	held := func() { answer <- nil; <-settled }
	p.start(7)
	require.Equal(t, int64(7), <-tries)
	p.start(7)
	held()
	require.Empty(t, tries, "one probe at a time")

	// No check answers (a silent path): the probe goes again by itself.
	select {
	case <-tries:
	case <-time.After(5 * OwnLockValidFor):
		t.Fatal("no probe again on a silent path")
	}
	held()
	for range slowStreak - 1 { // a slow path: each lapse probes, checks answer between
		answeredAt.Store(time.Now().Add(time.Hour).UnixNano())
		p.start(7)
		<-tries
		held()
	}
	p.start(7)
	time.Sleep(2 * OwnLockValidFor)
	require.Empty(t, tries, "probes pause on a slow path")
	require.NoError(t, ctx.Err(), "the session goes on")

	later.Store(int64(probeQuiet)) // the pause is over
	p.start(7)
	<-tries
	won := &lockedConn{key: 7}
	answer <- won
	<-ctx.Done()
	require.ErrorIs(t, context.Cause(ctx), errLockMoved, "a probe that took the lock ends the session")
	p.start(7)
	require.Same(t, won, p.result())
	require.Empty(t, tries, "no probe after the session ended")
}

// The session's end waits for a running probe and takes its connection.
func TestLockProbeResultWaitsForTheRunningProbe(t *testing.T) {
	answer := make(chan *lockedConn)
	tried := make(chan struct{})
	ctx, end := context.WithCancelCause(context.Background())
	p := newLockProbe(ctx, end,
		func(context.Context, int64) *lockedConn { close(tried); return <-answer },
		func() time.Time { return time.Time{} }, nil, nil)
	p.start(7)
	<-tried
	won := &lockedConn{key: 7}
	go func() { answer <- won }()
	require.Same(t, won, p.result())

	idle := newLockProbe(ctx, end, func(context.Context, int64) *lockedConn { panic("no probe") },
		func() time.Time { return time.Time{} }, nil, nil)
	require.Nil(t, idle.result(), "no probe ran")
}
