package pgoutbox

import (
	"fmt"
	"strings"
)

// ClaimMode chooses how a subscription takes rows.
//
// A lease claim writes every row it takes (a lease token and expiry) and
// commits before any handler runs; the ack deletes the row in a second
// write. A held claim locks the rows (SELECT ... FOR UPDATE SKIP LOCKED)
// in a transaction kept open while their handlers run, and deletes the
// acked rows in that transaction when the batch is done: one write and one
// commit per batch instead of two of each, about twice the drain rate for
// fast handlers. The held transaction never lives long: a row whose
// handler is still running after a short bound (or AckDeadline, when
// shorter) becomes an ordinary lease in that transaction, which then
// commits; so does a nacked or dead-lettered row, and it is then written
// like any lease's.
//
// Every guarantee holds on both paths: at-least-once delivery, writes
// guarded by the lease or the lock, renewal and AckDeadline, release at
// close, retries, dead letters, consumer groups, and ordering keys (a held
// row's key is as busy as a leased one's). The paths differ in three ways.
// If the process dies, its held rows are due again at once (the server
// rolls the transaction back when the connection drops), where leased rows
// wait for their holder to be found dead or their lease to expire; the
// acks of its open batches are lost with it, so those messages are
// delivered again. A held delivery is counted only when its row becomes a
// lease or its batch ends, so a crash before that would escape
// MaxDeliveries: a subscription with a limit leases every claim. And Stats counts
// held rows as ready (they are locked, not leased), and an operator's
// CancelScheduled or Unbind purge of a held row waits for the batch to end.
//
// A held batch keeps one pool connection while it runs, and only while the
// pool has spare connections: otherwise the subscription leases. Behind
// PgBouncer in transaction mode that is one server connection per open
// batch, for at most the bound.
type ClaimMode int

const (
	// ClaimAuto, the default, holds while the subscription is busy (its
	// last claim found rows) and the handlers are fast, and leases
	// otherwise: idle polls and the first claim after a wake-up, claims
	// that reclaim expired or orphaned leases or follow ordering keys,
	// a while after most handlers of a batch outlived the bound or a
	// batch's end failed, while the pool has no spare connection, and for
	// good once a handler completes a held row in its own transaction
	// (tx.Middleware, whose delete would wait for the batch's end).
	ClaimAuto ClaimMode = iota
	// ClaimLease always leases: no transaction stays open while handlers
	// run.
	ClaimLease
	// ClaimHeld holds every claim that may: not with MaxDeliveries set,
	// not those that reclaim leases or follow ordering keys, nor without a spare pool connection, nor a
	// while after a batch's end failed (so rows whose end fails again and
	// again are written, and counted, as leases). With tx.Middleware each
	// message ends its batch early: correct, but slower than ClaimAuto.
	ClaimHeld
)

// String returns "auto", "lease" or "held".
func (m ClaimMode) String() string {
	switch m {
	case ClaimAuto:
		return "auto"
	case ClaimLease:
		return "lease"
	case ClaimHeld:
		return "held"
	}
	return fmt.Sprintf("ClaimMode(%d)", int(m))
}

// ParseClaimMode parses "auto", "lease" or "held" (any case).
func ParseClaimMode(s string) (ClaimMode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "auto", "":
		return ClaimAuto, nil
	case "lease":
		return ClaimLease, nil
	case "held":
		return ClaimHeld, nil
	}
	return 0, fmt.Errorf("claim mode %q: use auto, lease or held", s)
}
