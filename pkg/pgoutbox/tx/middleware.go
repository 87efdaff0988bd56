package tx

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/handoff"
)

// ErrLeaseLost is returned by a handler behind Middleware when the
// message's lease was lost before its transaction could complete it (the
// message's AckDeadline or the subscriber's drain ended it first, its
// lease expired and another consumer took it, or, on the held path, the
// end of the batch that was to make the row a lease did not commit): the
// transaction was rolled
// back, the handler's writes with it, and the message is delivered again.
// Keep it out of a PoisonQueue (pgoutbox.Redelivered).
var ErrLeaseLost = errors.New("pgoutbox: the message's lease was lost before its transaction could complete it (AckDeadline, the subscriber's drain, an expired lease, or on the held path a batch end that failed, which the subscriber logs); the handler's transaction was rolled back and the message is delivered again")

// MiddlewareConfig configures Middleware.
type MiddlewareConfig struct {
	// Publisher publishes the messages the handler returns, inside the
	// handler's transaction, to the handler's publish topic. Give it a
	// publisher that follows the context (pgoutbox.NewContextPublisher):
	// the messages then exist if and only if the transaction commits.
	// Middleware refuses a pgoutbox Publisher that does not. Optional for handlers that return no messages; a handler that
	// returns messages without it fails (and its transaction rolls back).
	Publisher message.Publisher

	// CommitTimeout bounds what runs after the handler returned without an
	// error: completing the row, publishing its messages, COMMIT. These run
	// even if the message's context was cancelled meanwhile (a Router or
	// Subscriber closing), so finished work is committed, not rolled back
	// and redone. Defaults to 10s; at least 1ms (pgoutbox.MinDuration).
	CommitTimeout time.Duration
}

// contextFollower is a publisher that can tell whether it publishes in
// the transaction a message's context carries: pgoutbox's Publisher. One
// that does not is refused (a publisher of another kind is taken as it is).
type contextFollower interface{ FollowsContext() bool }

// DefaultCommitTimeout is MiddlewareConfig.CommitTimeout's default.
const DefaultCommitTimeout = 10 * time.Second

// Middleware returns a Router middleware that runs each message's handler
// in a transaction of its own, begun on db (FromSQLDB or FromPgxPool):
//
//  1. it begins a transaction and puts it into the message's context
//     (SQLTxFromContext, PgxTxFromContext, ExecutorFromContext): write
//     your domain rows in it;
//  2. it runs the handler;
//  3. for a message delivered by a pgoutbox Subscriber, it deletes the
//     message's row in the same transaction, under the lease the message
//     was delivered with. If the lease was lost (another consumer holds the
//     message now, or on the held path the batch end that was to make it a
//     lease did not commit) it rolls back and returns ErrLeaseLost;
//  4. it publishes the messages the handler returned in the same
//     transaction (MiddlewareConfig.Publisher) and returns none to the
//     Router. After the deletion: one may reuse the incoming message's
//     dedup key (a timer that re-arms itself);
//  5. it commits, with your database's durability settings.
//
// The transaction has the pool's default isolation
// (default_transaction_isolation); pgoutbox's own transactions (RunInTx)
// run READ COMMITTED.
//
// A handler error, a panic or a failed commit rolls everything back and
// the message is nacked: redelivered, its retry policy applying. So the
// handler's writes, its output messages and the message's completion
// happen together, once: effectively-once processing.
//
// Leave the transaction's end to it. A handler that commits or rolls it
// back (the driver's Commit or Rollback, or on a pgx pool a COMMIT or
// ROLLBACK statement) gets an error, and the message is delivered again;
// through database/sql a COMMIT or ROLLBACK statement goes unseen, and
// what follows it runs outside any transaction, as does a statement that
// opens another (COMMIT AND CHAIN, or BEGIN after it) anywhere.
//
// Add it to the Router after Retry (each attempt then gets a transaction
// of its own), PoisonQueue and Recoverer, and before middlewares that
// change the returned messages, such as CorrelationID: middlewares added
// later run inside it, and it publishes what they return.
func Middleware(db Executor, config MiddlewareConfig) (message.HandlerMiddleware, error) {
	b, ok := db.(beginner)
	nilPool, isNil := db.(nilHandle)
	switch {
	case db == nil:
		return nil, errtext.Errorf("pgoutbox: tx.Middleware begins a transaction per message, so it needs a pool: pass FromSQLDB or FromPgxPool, not nil")
	case isNil && !nilPool.inTx:
		return nil, errtext.Errorf("pgoutbox: tx.Middleware: %w", nilPool.err())
	case isNil || ok && db.InTx() || isOwnTx(db):
		return nil, errtext.Errorf("pgoutbox: tx.Middleware begins a transaction per message, so it needs a pool: pass FromSQLDB or FromPgxPool, not a transaction")
	case !ok:
		return nil, errtext.Errorf("pgoutbox: tx.Middleware begins a transaction per message, so it needs a pool: pass FromSQLDB or FromPgxPool, not an Executor of your own (%T)", db)
	}
	if f, ok := config.Publisher.(contextFollower); ok && !f.FollowsContext() {
		return nil, errtext.Errorf("pgoutbox: tx.MiddlewareConfig.Publisher publishes through a pool or transaction of its own, not the handler's: " +
			"the messages a handler returns would be stored even when its transaction rolls back; build it with pgoutbox.NewContextPublisher")
	}
	if config.CommitTimeout < 0 {
		return nil, errtext.Errorf("pgoutbox: tx.MiddlewareConfig.CommitTimeout is negative (%v); leave it 0 for the default (%v)", config.CommitTimeout, DefaultCommitTimeout)
	}
	if p := errtext.TooShort("CommitTimeout", config.CommitTimeout); p != "" {
		// Every commit would time out: each handler's work rolled back
		// and redone without end.
		return nil, errtext.Errorf("pgoutbox: tx.MiddlewareConfig.%s, or 0 for the default (%v)", p, DefaultCommitTimeout)
	}
	if config.CommitTimeout == 0 {
		config.CommitTimeout = DefaultCommitTimeout
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return runInHandlerTx(b, config, h, msg)
		}
	}, nil
}

// isOwnTx reports whether db is a transaction of this package's making
// (FromPgxTx, FromSQLTx, FromSQLQueryer): passed where a pool belongs, it
// is named as such. (Another Executor's InTx is not called: it may not
// expect a nil receiver.)
func isOwnTx(db Executor) bool {
	switch db.(type) {
	case pgxTx, sqlTx:
		return true
	}
	return false
}

func runInHandlerTx(b beginner, config MiddlewareConfig, h message.HandlerFunc, msg *message.Message) (_ []*message.Message, err error) {
	orig := msg.Context()
	row := handoff.From(orig)
	if row != nil && row.Completed() {
		// An earlier run committed this message (a middleware outside
		// failed after the commit and Retry runs the handler again): it is
		// done, and running it again could only roll back.
		return nil, nil
	}
	if row != nil && closed(msg.Acked()) {
		// Acked before the handler ran (middleware.InstantAck, or an Ack
		// in a middleware outside this one): the subscriber deletes the
		// row on its own, and the transaction's DELETE would race it and
		// report a lost lease that is none.
		return nil, errtext.Errorf("pgoutbox: tx.Middleware got message %s already acked (middleware.InstantAck, or a middleware outside it that acks): "+
			"its row is deleted without the handler's work; remove that middleware, tx.Middleware completes the row in the handler's transaction", msg.UUID)
	}
	if row != nil {
		// Before the transaction begins: a snapshot older than the lease
		// (REPEATABLE READ or SERIALIZABLE by default) would not find it.
		row.Prepare()
	}
	// Not orig itself: database/sql rolls a transaction back when the
	// context of its BeginTx ends, and a finished handler's work must
	// still commit (see CommitTimeout).
	exec, commit, rollback, err := b.begin(context.WithoutCancel(orig), poolDefault)
	if err != nil {
		return nil, errtext.Errorf("pgoutbox: begin the handler's transaction: %w", err)
	}
	committed, nackAfter := false, false
	defer func() {
		// The message goes back to the Router (and its other middlewares)
		// with its own context: the transaction is over.
		msg.SetContext(orig)
		if committed {
			return
		}
		// Bounded: a drain waits for this transaction to end.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(orig), config.CommitTimeout)
		defer cancel()
		_ = rollback(rctx)
		if row != nil {
			row.End(false)
		}
		if nackAfter {
			msg.Nack() // after the rollback: the redelivery must not wait on its locks
		}
	}()
	msg.SetContext(WithExecutor(orig, exec))

	// The handler gets a copy whose Ack and Nack are its own: the row is
	// completed by this transaction, so an Ack inside it (the handler's
	// own, or middleware.InstantAck inside tx.Middleware) must not let the
	// subscriber delete the row while the transaction is open (the
	// completion would then find no row and roll the handler's work
	// back). The transaction decides; a Nack with no error is a Nack.
	inner := msg.CopyWithContext()
	produced, err := h(inner)
	msg.Metadata, msg.Payload = inner.Metadata, inner.Payload // edits are seen outside, as without the copy
	if err == nil && closed(inner.Nacked()) {
		nackAfter = true
		return nil, nil // rolled back, then nacked; the Router's Ack finds the message nacked
	}
	if err != nil {
		if errtext.SQLState(err) == "25P02" { // in_failed_sql_transaction
			// Retry inside tx.Middleware runs every attempt in the one
			// transaction the first attempt's failed statement aborted.
			return nil, errtext.Errorf("%w (a statement earlier in the handler's transaction failed and aborted it; if Retry runs "+
				"inside tx.Middleware, put it outside, so that each attempt gets a transaction of its own: see the README's middleware order)", err)
		}
		return nil, err
	}
	// The handler is done: finish its work even if the message's context
	// ends now (a closing Router), within CommitTimeout. From here the
	// subscriber leaves the row to this transaction: a drain that ends now
	// waits for it instead of giving the row back under it.
	fin, cancel := context.WithTimeout(context.WithoutCancel(orig), config.CommitTimeout)
	defer cancel()
	if row != nil {
		row.Begin()
	}
	if e, ok := exec.(endedBySQL); ok && e.endedBySQL() {
		// A COMMIT or ROLLBACK the handler ran as a statement, which the
		// driver's transaction knows nothing of: what follows would run
		// on its own, the completion deleting the row at once.
		return nil, endedByHandler(msg, fmt.Errorf("%w: by a COMMIT or ROLLBACK statement", ErrTxDone))
	}
	if row != nil {
		stmt, args := row.Completion()
		n, err := exec.Exec(fin, stmt, args...)
		if errors.Is(err, ErrTxDone) {
			return nil, endedByHandler(msg, err)
		}
		if err != nil {
			return nil, errtext.Errorf("pgoutbox: complete the message in the handler's transaction: %w%s", err, swallowed(err))
		}
		if n == 0 {
			// Permanent: Watermill's Retry must not run the handler again,
			// each run could only roll back.
			if err := elsewhere(fin, exec, row.Database()); err != nil {
				return nil, backoff.Permanent(err)
			}
			return nil, backoff.Permanent(ErrLeaseLost)
		}
	}
	// After the completion: a returned message may take the incoming
	// one's dedup key (a timer that re-arms itself), which is free once
	// its row is gone, here in this transaction.
	if len(produced) > 0 {
		if err := publishInTx(fin, exec, config, msg, produced); errors.Is(err, ErrTxDone) {
			return nil, endedByHandler(msg, ErrTxDone) // not err: its advice is for code that publishes
		} else if err != nil {
			return nil, err
		}
	}
	if err := commit(fin); err != nil {
		if err = mapErr(err); errors.Is(err, ErrTxDone) {
			return nil, endedByHandler(msg, err)
		}
		if commitUnanswered(err) {
			if row != nil {
				row.CommitUnanswered()
			}
			return nil, errtext.Errorf("pgoutbox: commit the handler's transaction: %w (%w); "+
				"if it committed, the message is done and is not delivered again, else it is", ErrCommitUnanswered, err)
		}
		return nil, errtext.Errorf("pgoutbox: commit the handler's transaction: %w%s", err, swallowed(err))
	}
	committed = true
	if row != nil {
		row.End(true)
	}
	return nil, nil
}

// commitUnanswered reports whether a COMMIT's error leaves its outcome
// unknown: no answer of the server's came back (no SQLSTATE: a connection
// that broke, or CommitTimeout that passed). pgconn counts its "conn
// closed" as nothing sent, but server crashes during a tx.Middleware
// drain gave it for transactions whose writes were there after the
// restart: every error without the server's answer counts. A refused
// COMMIT (a serialization failure, an aborted transaction, lib/pq's
// COMMIT after a ROLLBACK statement) rolled back.
func commitUnanswered(err error) bool {
	return !errors.Is(err, pgx.ErrTxCommitRollback) && errtext.SQLState(err) == "" && swallowed(err) == "" &&
		!strings.Contains(err.Error(), "unexpected transaction status")
}

// swallowed is the hint for a statement of pgoutbox's that found the
// handler's transaction aborted although the handler returned nil: one of
// its statements failed and its error was dropped.
func swallowed(err error) string {
	// lib/pq does not send the COMMIT of a failed transaction; its error
	// has no SQLSTATE, only this text.
	if errtext.SQLState(err) != "25P02" && !errors.Is(err, pgx.ErrTxCommitRollback) && // in_failed_sql_transaction
		(err == nil || !strings.Contains(err.Error(), "Could not complete operation in a failed transaction")) {
		return ""
	}
	return " (a statement of the handler failed and the handler returned nil: return that statement's error, or run the statement in a savepoint if its failure is expected)"
}

func publishInTx(fin context.Context, exec Executor, config MiddlewareConfig, msg *message.Message, produced []*message.Message) error {
	if config.Publisher == nil {
		return errtext.Errorf("pgoutbox: the handler returned %d messages, but tx.MiddlewareConfig.Publisher is not set; set it to a publisher that follows the context (pgoutbox.NewContextPublisher) so they commit with the handler's transaction", len(produced))
	}
	topic := message.PublishTopicFromCtx(msg.Context())
	if topic == "" {
		return errtext.Errorf("pgoutbox: the handler returned %d messages but has no publish topic; add it with Router.AddHandler and a publish topic", len(produced))
	}
	for i, m := range produced {
		// Every message carries the transaction (a publisher that splits
		// the call still finds it); the first one's context is the one the
		// statement runs with: the finishing context, which the end of the
		// message's own cannot cancel, with the message's own values in
		// front of the handler's (a span the handler gave it, say).
		ctx := m.Context()
		if i == 0 {
			ctx = valuesOver{Context: fin, own: ctx}
		}
		m.SetContext(WithExecutor(ctx, exec))
	}
	if err := config.Publisher.Publish(topic, produced...); err != nil {
		return errtext.Errorf("pgoutbox: publish the handler's messages in its transaction: %w%s", err, swallowed(err))
	}
	return nil
}

// valuesOver is Context (its deadline and cancellation, and its values)
// with the values of own in front.
type valuesOver struct {
	context.Context
	own context.Context
}

func (v valuesOver) Value(key any) any {
	if x := v.own.Value(key); x != nil {
		return x
	}
	return v.Context.Value(key)
}

// endedByHandler is the error for a handler's transaction that was over
// before tx.Middleware could finish it.
func endedByHandler(msg *message.Message, err error) error {
	return errtext.Errorf("pgoutbox: finish message %s in the handler's transaction: %w: the handler (or code it called) ended it; "+
		"tx.Middleware commits it when the handler returns nil and rolls it back when it returns an error, so leave both to it "+
		"(what the handler committed stays, and the message is delivered again)", msg.UUID, err)
}

// closed reports whether c is closed: whether a message's Acked() or
// Nacked() happened already.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// elsewhere returns an error when exec is connected to another database
// than the subscriber's (a pool of the application's other database
// given to Middleware, with the outbox tables there too): every message
// would look like a lost lease.
func elsewhere(ctx context.Context, exec Executor, database string) error {
	if database == "" {
		return nil
	}
	rows, err := exec.Query(ctx, "SELECT current_database()")
	if err != nil {
		return nil
	}
	defer rows.Close()
	var here string
	if !rows.Next() || rows.Scan(&here) != nil || here == database {
		return nil
	}
	return fmt.Errorf("pgoutbox: the handler's transaction runs in database %q, but the subscriber's messages are in database %q, "+
		"so it could not complete the message; give tx.Middleware an executor on the subscriber's database "+
		"(the transaction was rolled back; the message fails as with any handler error)", here, database)
}

// endedBySQL is an executor that can tell when its transaction was ended
// by a statement (pgx's: its connection reports no transaction open).
type endedBySQL interface{ endedBySQL() bool }
