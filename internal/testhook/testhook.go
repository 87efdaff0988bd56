// Package testhook lets the project's own tests steer choices the engine
// otherwise makes by itself, such as the claim path, so a test of a
// guarantee runs on the path it names instead of retrying until the path
// it wanted happened. Nothing outside tests sets a hook.
package testhook

import (
	"sync"
	"time"
)

// Claim paths a test can force.
const (
	PathHeld  = "held"
	PathLease = "lease"
	// PathAutoBusy leaves a ClaimAuto subscriber its own choice, as if
	// it were busy from its first claim: it holds where ClaimAuto holds
	// for a busy consumer (not after a slow short claim, which on a
	// loaded machine is any claim), and still leases for good once a
	// handler completed its row in its own transaction, after slow
	// handlers or a failed batch end, and for ordering keys.
	PathAutoBusy = "auto-busy"
)

var claimPaths sync.Map // worker id -> path

// ForceClaimPath makes every claim of the subscriber with workerID take
// path (PathHeld: even the first claims and those that would lease to
// reclaim expired leases or follow ordering keys; a claim still leases
// when the pool has no spare connection or three batches are open).
// An empty path removes the hook.
func ForceClaimPath(workerID, path string) {
	if path == "" {
		claimPaths.Delete(workerID)
		return
	}
	claimPaths.Store(workerID, path)
}

// ClaimPath returns the path forced for workerID, or "".
func ClaimPath(workerID string) string {
	p, _ := claimPaths.Load(workerID)
	s, _ := p.(string)
	return s
}

var heldBounds sync.Map // worker id -> time.Duration

// SetHeldBound makes the held batches of the subscriber with workerID
// wait up to d for their handlers before the rows still running become
// leases, instead of the engine's bound (100ms): a test can then act
// while a batch holds its rows, however slow the machine. 0 removes the
// hook.
func SetHeldBound(workerID string, d time.Duration) {
	if d == 0 {
		heldBounds.Delete(workerID)
		return
	}
	heldBounds.Store(workerID, d)
}

// HeldBound returns the bound forced for workerID, or 0.
func HeldBound(workerID string) time.Duration {
	d, _ := heldBounds.Load(workerID)
	v, _ := d.(time.Duration)
	return v
}

// durations is a hook of a duration per outbox (its quoted name, as
// query.Names.QTable).
type durations struct{ m sync.Map }

func (h *durations) set(table string, d time.Duration) {
	if d == 0 {
		h.m.Delete(table)
		return
	}
	h.m.Store(table, d)
}

func (h *durations) get(table string) time.Duration {
	d, _ := h.m.Load(table)
	v, _ := d.(time.Duration)
	return v
}

var rotateLockTimeouts, rotateStuckAfter durations

// SetRotateLockTimeout makes the rotation steps of the outbox named table
// (quoted, as query.Names.QTable) wait up to d for a TRUNCATE's lock
// instead of schema.RotateLockTimeout, so a test can change a partition
// while the TRUNCATE waits, or outwait autovacuum. 0 removes the hook.
func SetRotateLockTimeout(table string, d time.Duration) { rotateLockTimeouts.set(table, d) }

// RotateLockTimeout returns the lock timeout forced for the rotation steps
// of table, or 0.
func RotateLockTimeout(table string) time.Duration { return rotateLockTimeouts.get(table) }

// SetRotateStuckAfter makes the rotation steps of the outbox named table
// move a stuck partition's rows once the ring has waited three windows
// and d, instead of three windows and at least schema's floor (30 s): a
// test's windows are microseconds. 0 removes the hook.
func SetRotateStuckAfter(table string, d time.Duration) { rotateStuckAfter.set(table, d) }

// RotateStuckAfter returns the floor forced for table, or 0.
func RotateStuckAfter(table string) time.Duration { return rotateStuckAfter.get(table) }

var writerWaits sync.Map // quoted outbox table -> time.Duration

// SetBindWriterWait makes a binding of a topic of the outbox qtable
// ("schema"."table") wait up to d for the transactions writing to the
// outbox, instead of the engine's 10 s: a test of what happens past that
// wait need not sit through it. 0 removes the hook.
func SetBindWriterWait(qtable string, d time.Duration) {
	if d == 0 {
		writerWaits.Delete(qtable)
		return
	}
	writerWaits.Store(qtable, d)
}

// BindWriterWait returns the wait set for qtable, or 0.
func BindWriterWait(qtable string) time.Duration {
	d, _ := writerWaits.Load(qtable)
	w, _ := d.(time.Duration)
	return w
}

var clockSteps sync.Map // worker id -> time.Duration

// StepClockOnce makes the next lease claim of the subscriber with
// workerID that has a deadline go by a clock stepped back by d since the
// claim before: its deadline comes d earlier, as this machine's clock
// stepping back would make it. Once.
func StepClockOnce(workerID string, d time.Duration) { clockSteps.Store(workerID, d) }

// TakeClockStep returns the step StepClockOnce set for workerID, and
// removes it; 0 when none.
func TakeClockStep(workerID string) time.Duration {
	v, ok := clockSteps.LoadAndDelete(workerID)
	if !ok {
		return 0
	}
	return v.(time.Duration)
}
