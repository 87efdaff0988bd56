package pgoutbox

import (
	"fmt"
	"strings"
)

// ClaimMode chooses how a subscription takes rows.
//
// A lease claim writes every row it takes (a lease token and expiry: a new
// row version and index entries) and commits, and its ack deletes the row
// in a second write: two writes and two commits per batch, whatever the
// handlers do. A held claim locks the rows (SELECT ... FOR UPDATE SKIP
// LOCKED) in a transaction the subscription keeps open while their
// handlers run, and deletes the acked rows in that transaction when the
// batch is done: one write and one commit, about twice the drain rate. The
// held transaction never lives long: when a handler of the batch is still
// running after a short bound (100ms, or AckDeadline when shorter), its row
// becomes an ordinary lease in that transaction, which then commits. A nack,
// a dead letter or a give-back turns its row into a lease the same way, and
// is written like any lease's.
//
// Every guarantee holds on both paths: at-least-once delivery, lease
// tokens, renewal and AckDeadline for rows that became leases, release at
// close, retries, dead letters, consumer groups, ordering keys. If the
// process dies, the rows of its held transactions are due again at once
// (the server rolls the transaction back when the connection drops), where
// leased rows wait for their lease to expire or their holder to be found
// dead. One difference: a delivery that ends in a crash before its row
// became a lease is not counted against MaxDeliveries.
//
// A held claim keeps one pool connection for as long as its batch runs (at
// most three per subscription, and only while the pool has spare
// connections: otherwise the subscription leases). Behind PgBouncer in
// transaction mode that is one server connection per open batch, for at
// most the bound.
type ClaimMode int

const (
	// ClaimAuto, the default, claims on the held path after a claim that
	// found rows (a busy subscription), and leases otherwise: an idle
	// poll, the first claim after a wake-up, the claims that must lease
	// (reclaiming expired or orphaned leases, claims that follow ordering
	// keys); while the handlers are slow (most rows of recent batches
	// outlived the bound; it tries the held path again 10s later); while
	// the pool has fewer than two idle connections; and for good once a
	// handler completes a held row in its own transaction (tx.Middleware,
	// whose delete has to wait for the held transaction's end).
	ClaimAuto ClaimMode = iota
	// ClaimLease always leases: each claim writes its rows and commits
	// before any handler runs. No transaction stays open while handlers
	// run.
	ClaimLease
	// ClaimHeld uses the held path for every claim that may: not for the
	// reclaiming and ordering-key claims, nor without a spare pool
	// connection, nor for 10s after a batch's end failed (so rows whose
	// end fails again and again are written, and counted, as leases). With tx.Middleware each message then ends its batch
	// early: correct, but slower than ClaimAuto.
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
