// Package handoff connects a delivered message to the transaction of the
// handler that processes it (tx.Middleware): the subscriber puts the
// claimed row behind each message into the message's context, and the
// middleware deletes that row in the handler's transaction.
package handoff

import "context"

// Row is the claimed row behind a delivered message.
type Row interface {
	// Prepare makes the row ready for a transaction to delete it, and
	// returns once it is: a held row becomes a lease, committed. Call it
	// before the transaction's first statement: one whose snapshot is
	// older (REPEATABLE READ, SERIALIZABLE) would not see the lease.
	Prepare()
	// Completion returns the statement, and its arguments, that delete the
	// row under the lease it was delivered with: one row affected, or none
	// when the lease was lost.
	Completion() (sql string, args []any)
	// Database is the name of the database the row is in, for an error
	// that says so when the transaction's connection is elsewhere.
	Database() string
	// Begin announces that the handler returned and its transaction is
	// finishing (publishing the handler's output, deleting the row), so
	// the subscriber does not take the row's disappearance for a lost
	// lease, nor give the row back under it at a drain's end. End reports
	// whether that transaction committed: then the subscriber writes
	// nothing more for the row.
	Begin()
	End(committed bool)
	// CommitUnanswered reports, before End(false), that the transaction's
	// COMMIT was sent and its answer lost (the connection broke): it may
	// have committed, and then the row is gone because the message is
	// done, not because the lease was lost.
	CommitUnanswered()
	// Completed reports whether a transaction deleted the row and
	// committed: the message is done, whatever runs after.
	Completed() bool
}

type key struct{}

// With returns ctx carrying r.
func With(ctx context.Context, r Row) context.Context { return context.WithValue(ctx, key{}, r) }

// From returns the row ctx carries, or nil.
func From(ctx context.Context) Row {
	r, _ := ctx.Value(key{}).(Row)
	return r
}
