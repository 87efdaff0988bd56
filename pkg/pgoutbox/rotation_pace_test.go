package pgoutbox

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// The rotators of one outbox in a process take turns: one step each fifth
// of a window between them, however many Subscribers run one; after steps
// whose TRUNCATE gave up on its lock (a transaction holds the partition:
// every claim waited for that lock meanwhile) the next waits longer,
// doubling up to a window, until a step meets no lock timeout.
func TestRotationPaceTakesTurnsAndBacksOffWhileAPartitionIsHeld(t *testing.T) {
	t.Parallel()
	const every, window = 600 * time.Millisecond, 3 * time.Second
	table := uuid.NewString() // the paces are the process's: a table of this run's own
	p := paceOf(rotationKey{outbox: "h:5432/d " + table, window: window})
	require.Same(t, p, paceOf(rotationKey{outbox: "h:5432/d " + table, window: window}), "one pace per outbox")
	require.NotSame(t, p, paceOf(rotationKey{outbox: "other:5432/d " + table, window: window}))
	require.NotSame(t, p, paceOf(rotationKey{outbox: "h:5432/d " + table, window: time.Minute}), "nor one for every window")

	t0 := time.Now()
	steps := 0
	for i := range 12 { // twelve rotators' ticks within one step's time
		if p.turn(t0.Add(time.Duration(i)*10*time.Millisecond), every) {
			steps++
		}
	}
	require.Equal(t, 1, steps, "one step for all of them")
	require.True(t, p.turn(t0.Add(every-every/8), every), "the next a fifth of a window later, a tick's late clock read aside")
	t0 = t0.Add(every - every/8)

	at := t0
	var waits []time.Duration
	for range 5 {
		p.stepped(at, 1, every, window)
		wait := p.next.Sub(at)
		require.False(t, p.turn(at.Add(wait-every/4-time.Millisecond), every))
		require.True(t, p.turn(at.Add(wait), every))
		waits = append(waits, wait)
		at = at.Add(wait)
	}
	require.Equal(t, []time.Duration{every, 2 * every, 4 * every, window, window}, waits)
	p.stepped(at, 0, every, window)
	require.True(t, p.turn(at.Add(every), every), "a step without a lock timeout ends the backoff")
}

// One rotator alone steps at every tick of its ticker, whose ticks its
// clock reads late by a varying delay: without slack it missed one tick in
// four.
func TestRotationPaceOfOneRotatorTakesEveryTick(t *testing.T) {
	t.Parallel()
	const every = 20 * time.Millisecond
	p := paceOf(rotationKey{outbox: "h:5432/d " + uuid.NewString(), window: 5 * every})
	start := time.Now()
	steps := 0
	for i := range 150 {
		late := time.Duration((i*7919)%4000) * time.Microsecond // 0-4 ms, varying
		if p.turn(start.Add(time.Duration(i)*every+late), every) {
			steps++
		}
	}
	require.Equal(t, 150, steps)
}
