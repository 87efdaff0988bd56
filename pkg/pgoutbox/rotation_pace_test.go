package pgoutbox

import (
	"testing"
	"time"

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
	p := paceOf(rotationKey{database: "h:5432/d", table: t.Name()})
	require.Same(t, p, paceOf(rotationKey{database: "h:5432/d", table: t.Name()}), "one pace per outbox")
	require.NotSame(t, p, paceOf(rotationKey{database: "other:5432/d", table: t.Name()}))

	t0 := time.Now()
	steps := 0
	for i := range 12 { // twelve rotators' ticks within one step's time
		if p.turn(t0.Add(time.Duration(i)*10*time.Millisecond), every) {
			steps++
		}
	}
	require.Equal(t, 1, steps, "one step for all of them")
	require.True(t, p.turn(t0.Add(every), every), "the next a fifth of a window later")

	at := t0.Add(every)
	var waits []time.Duration
	for range 5 {
		p.stepped(at, 1, every, window)
		wait := p.next.Sub(at)
		require.False(t, p.turn(at.Add(wait-time.Millisecond), every))
		require.True(t, p.turn(at.Add(wait), every))
		waits = append(waits, wait)
		at = at.Add(wait)
	}
	require.Equal(t, []time.Duration{every, 2 * every, 4 * every, window, window}, waits)
	p.stepped(at, 0, every, window)
	require.True(t, p.turn(at.Add(every), every), "a step without a lock timeout ends the backoff")
}
