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

var rotateLockTimeouts sync.Map // quoted outbox name -> time.Duration

// SetRotateLockTimeout makes the rotation steps of the outbox named table
// (quoted, as query.Names.QTable) wait up to d for a TRUNCATE's lock
// instead of schema.RotateLockTimeout, so a test can change a partition
// while the TRUNCATE waits, or outwait autovacuum. 0 removes the hook.
func SetRotateLockTimeout(table string, d time.Duration) {
	if d == 0 {
		rotateLockTimeouts.Delete(table)
		return
	}
	rotateLockTimeouts.Store(table, d)
}

// RotateLockTimeout returns the lock timeout forced for the rotation steps
// of table, or 0.
func RotateLockTimeout(table string) time.Duration {
	d, _ := rotateLockTimeouts.Load(table)
	v, _ := d.(time.Duration)
	return v
}

var rotateStuckAfter sync.Map // quoted outbox name -> time.Duration

// SetRotateStuckAfter makes the rotation steps of the outbox named table
// move a stuck partition's rows once the ring has waited 3 windows,
// however short, instead of at least schema's floor: a test's windows are
// microseconds. 0 removes the hook.
func SetRotateStuckAfter(table string, d time.Duration) {
	if d == 0 {
		rotateStuckAfter.Delete(table)
		return
	}
	rotateStuckAfter.Store(table, d)
}

// RotateStuckAfter returns the floor forced for table, or 0.
func RotateStuckAfter(table string) time.Duration {
	d, _ := rotateStuckAfter.Load(table)
	v, _ := d.(time.Duration)
	return v
}
