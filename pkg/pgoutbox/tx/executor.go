// Package tx lets pgoutbox run its statements on whatever handle the caller
// has: a database/sql transaction or pool, a pgx
// transaction, or a pgxpool. A transaction-bound Executor never begins,
// commits or rolls back the caller's transaction.
package tx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrTxDone is returned when a statement runs on a transaction that was
// already committed or rolled back.
var ErrTxDone = errors.New("pgoutbox: the transaction is already committed or rolled back")

// Executor runs statements on a database handle or on an open transaction.
// Build one with FromSQLTx, FromSQLDB, FromSQLQueryer, FromPgxTx or
// FromPgxPool.
type Executor interface {
	// Exec runs a statement and returns the number of rows it affected.
	Exec(ctx context.Context, sql string, args ...any) (int64, error)
	// Query runs a statement that returns rows. The caller closes them.
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
	// InTx reports whether statements run inside a transaction the caller
	// owns (and commits).
	InTx() bool
}

// Rows is the part of a result set pgoutbox reads.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close()
}

// beginner is implemented by the executors that own a pool and can start a
// transaction of their own: READ COMMITTED for pgoutbox's own work
// (RunInTx), at the pool's default for a handler's (Middleware).
type beginner interface {
	begin(ctx context.Context, iso isolation) (Executor, func(context.Context) error, func(context.Context) error, error)
}

// isolation is the level a beginner's transaction runs at.
type isolation int

const (
	readCommitted isolation = iota // READ COMMITTED, whatever the pool's default
	poolDefault                    // default_transaction_isolation of the connection
)

// FromSQLTx binds an Executor to a database/sql transaction. Any
// PostgreSQL driver serves: the pgx stdlib driver
// (github.com/jackc/pgx/v5/stdlib) and lib/pq from v1.11 take pgoutbox's
// array parameters as they are; with a driver that refuses Go slices
// (lib/pq before v1.11, bun's pgdriver) a statement that has some runs
// again with them written as array literals.
func FromSQLTx(tx *sql.Tx) Executor {
	if tx == nil {
		return nilHandle{"FromSQLTx", "*sql.Tx", true}
	}
	return sqlTx{tx}
}

// FromSQLDB runs each statement on its own connection from a database/sql
// pool (any PostgreSQL driver, as for FromSQLTx); each statement commits
// on its own.
func FromSQLDB(db *sql.DB) Executor {
	if db == nil {
		return nilHandle{"FromSQLDB", "*sql.DB", false}
	}
	return sqlDB{db}
}

// FromPgxTx binds an Executor to a pgx transaction.
func FromPgxTx(tx pgx.Tx) Executor {
	if tx == nil {
		return nilHandle{"FromPgxTx", "pgx.Tx", true}
	}
	return pgxTx{tx}
}

// FromPgxPool runs each statement on its own connection from a pgxpool; each
// statement commits on its own.
func FromPgxPool(pool *pgxpool.Pool) Executor {
	if pool == nil {
		return nilHandle{"FromPgxPool", "*pgxpool.Pool", false}
	}
	return pgxPool{pool, &poolDefaults{}}
}

// SQLQueryer is the part of a database/sql handle pgoutbox uses. *sql.Tx,
// *sql.DB and *sql.Conn have it, and so do the handles of libraries built
// on database/sql: *sqlx.Tx, GORM's Statement.ConnPool (a *sql.Tx, or with
// PrepareStmt a wrapper that prepares each statement), bun.Tx.
type SQLQueryer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// FromSQLQueryer binds an Executor to a database/sql-like handle that runs
// its statements in a transaction the caller owns, for handles that are
// not an *sql.Tx (FromSQLTx): inside GORM's db.Transaction,
// tx.FromSQLQueryer(gormTx.Statement.ConnPool), which is not an *sql.Tx
// with PrepareStmt; an *sqlx.Tx, a bun.Tx, or an *sql.Conn on which the
// caller ran BEGIN. Any PostgreSQL driver serves, as for FromSQLTx. q must
// be bound to a transaction: pgoutbox takes it for one (InTx is true), and
// never begins, commits or rolls back; for a pool, use FromSQLDB. Given an
// *sql.DB (a sqlc DBTX before WithTx holds one), it returns FromSQLDB's
// Executor: a pool taken for a transaction would have a Publisher
// ignore its StatementTimeout and refuse every Publish once closed.
func FromSQLQueryer(q SQLQueryer) Executor {
	if q == nil {
		return nilHandle{"FromSQLQueryer", "SQLQueryer", true}
	}
	if v := reflect.ValueOf(q); v.Kind() == reflect.Pointer && v.IsNil() {
		return nilHandle{"FromSQLQueryer", fmt.Sprintf("%T", q), true}
	}
	if db, ok := q.(*sql.DB); ok {
		return FromSQLDB(db)
	}
	return sqlTx{q}
}

func sqlExec(ctx context.Context, q SQLQueryer, query string, args []any) (int64, error) {
	res, err := q.ExecContext(ctx, query, args...)
	if refusedArgument(err) {
		if lit, ok := withArrayLiterals(args); ok {
			res, err = q.ExecContext(ctx, query, lit...)
		}
	}
	if err != nil {
		return 0, mapErr(err)
	}
	return res.RowsAffected()
}

func sqlQuery(ctx context.Context, q SQLQueryer, query string, args []any) (Rows, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if refusedArgument(err) {
		if lit, ok := withArrayLiterals(args); ok {
			rows, err = q.QueryContext(ctx, query, lit...)
		}
	}
	if err != nil {
		return nil, mapErr(err)
	}
	return sqlRows{rows}, nil
}

// sqlTx runs statements in the caller's database/sql transaction: an
// *sql.Tx (FromSQLTx), or a handle bound to one (FromSQLQueryer).
type sqlTx struct{ q SQLQueryer }

func (e sqlTx) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	return sqlExec(ctx, e.q, q, args)
}
func (e sqlTx) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	return sqlQuery(ctx, e.q, q, args)
}
func (sqlTx) InTx() bool { return true }

type sqlDB struct{ db *sql.DB }

func (e sqlDB) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	return sqlExec(ctx, e.db, q, args)
}
func (e sqlDB) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	return sqlQuery(ctx, e.db, q, args)
}
func (sqlDB) InTx() bool { return false }
func (e sqlDB) begin(ctx context.Context, iso isolation) (Executor, func(context.Context) error, func(context.Context) error, error) {
	var opts *sql.TxOptions // nil: the connection's default
	if iso == readCommitted {
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	t, err := e.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, nil, nil, err
	}
	return sqlTx{t}, func(context.Context) error { return t.Commit() }, func(context.Context) error { return t.Rollback() }, nil
}

// BoundedByServer is pgxPool's for a database/sql pool: each statement runs
// in a transaction of its own after a set_config of its statement_timeout.
// database/sql sends no batch, so that is four round trips (BEGIN, the
// setting, the statement, COMMIT) where a pgx pool takes one: the price of
// an error that means nothing was written.
func (e sqlDB) BoundedByServer(d time.Duration) Executor {
	return sqlServerBounded{db: e.db, timeout: d}
}

// sqlServerBounded runs each statement as serverBounded does, in a
// database/sql transaction.
type sqlServerBounded struct {
	db      *sql.DB
	timeout time.Duration
}

func (e sqlServerBounded) begin(ctx context.Context) (*sql.Tx, error) {
	began := time.Now()
	t, err := e.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		if st := e.db.Stats(); ctx.Err() != nil && st.MaxOpenConnections > 0 && st.InUse >= st.MaxOpenConnections {
			return nil, noConnection(st.InUse, st.MaxOpenConnections, err)
		}
		return nil, mapErr(err)
	}
	timeout, ok := boundLeft(e.timeout, began)
	if !ok {
		st := e.db.Stats()
		_ = t.Rollback()
		return nil, lateConnection(st.InUse, st.MaxOpenConnections, time.Since(began))
	}
	if _, err := t.ExecContext(ctx, "SELECT set_config('statement_timeout', $1, true)", timeout); err != nil {
		_ = t.Rollback()
		return nil, mapErr(err)
	}
	return t, nil
}

func (e sqlServerBounded) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	t, err := e.begin(ctx)
	if err != nil {
		return 0, err
	}
	n, err := sqlExec(ctx, t, q, args)
	if err != nil {
		_ = t.Rollback()
		return 0, err
	}
	if err := t.Commit(); err != nil {
		return 0, commitUnknown(ctx, err) // not mapErr: see Query
	}
	return n, nil
}

func (e sqlServerBounded) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	t, err := e.begin(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := sqlQuery(ctx, t, q, args)
	if err != nil {
		_ = t.Rollback()
		return nil, err
	}
	// Committed once the rows were read to their end, rolled back
	// otherwise: a caller that stopped early (a row that did not scan)
	// reports an error, and must not have written. A failed commit's error
	// stays as it is: mapErr would call a commit that lost a race with its
	// context "a finished transaction" (ErrTxDone), and send a pool's user
	// looking for a transaction of theirs.
	return &txRows{Rows: rows, finish: func(readAll bool, rowsErr error) error {
		if readAll && rowsErr == nil {
			return commitUnknown(ctx, t.Commit())
		}
		_ = t.Rollback()
		if rowsErr != nil {
			return rowsErr
		}
		return errors.New("pgoutbox: the rows of a statement were not read to their end; it was rolled back")
	}}, nil
}

func (sqlServerBounded) InTx() bool { return false }

// commitUnknown marks the error of a database/sql COMMIT that was sent and
// got no answer before ctx ended as ErrOutcomeUnknown. Commit returns the
// context's own error, sending nothing, when the context ended before it
// (database/sql rolls the transaction back): that wrote nothing, as every
// earlier step's failure did.
func commitUnknown(ctx context.Context, err error) error {
	if err == nil || ctx.Err() == nil || err == ctx.Err() || errors.Is(err, sql.ErrTxDone) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
}

type sqlRows struct{ *sql.Rows }

func (r sqlRows) Close() { _ = r.Rows.Close() }

type pgxQueryer interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func pgxExec(ctx context.Context, q pgxQueryer, query string, args []any) (int64, error) {
	tag, err := q.Exec(ctx, query, args...)
	if err != nil {
		return 0, mapErr(err)
	}
	return tag.RowsAffected(), nil
}

func pgxQuery(ctx context.Context, q pgxQueryer, query string, args []any) (Rows, error) {
	rows, err := q.Query(ctx, query, args...)
	if err != nil {
		return nil, mapErr(err)
	}
	return rows, nil
}

type pgxTx struct{ tx pgx.Tx }

// endedBySQL reports whether a COMMIT or ROLLBACK statement ended the
// transaction e was begun as (one pgoutbox began: endingTx) while the
// driver still takes it for open: its connection has none open.
func (e pgxTx) endedBySQL() bool {
	t, ok := e.tx.(*endingTx)
	if !ok || t.ended.Load() {
		return false // unknown, or ended through the driver: its own error follows
	}
	c := t.Conn()
	return c != nil && c.PgConn().TxStatus() == 'I'
}

func (e pgxTx) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	return pgxExec(ctx, e.tx, q, args)
}
func (e pgxTx) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	return pgxQuery(ctx, e.tx, q, args)
}
func (pgxTx) InTx() bool { return true }

type pgxPool struct {
	pool *pgxpool.Pool
	defs *poolDefaults
}

func isolationKnown(readCommitted bool) int32 {
	if readCommitted {
		return 1
	}
	return 2
}

// poolDefaults is what the statements bounded by the server learn of the
// pool's sessions: whether their default isolation is READ COMMITTED.
type poolDefaults struct {
	// isolation: 0 not known yet, 1 READ COMMITTED, 2 another level.
	isolation atomic.Int32
}

func (e pgxPool) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	return pgxExec(ctx, e.pool, q, args)
}
func (e pgxPool) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	return pgxQuery(ctx, e.pool, q, args)
}
func (pgxPool) InTx() bool { return false }

// BoundedByServer returns an Executor on the same pool whose statements
// run with statement_timeout d less the wait for a connection (a wait
// that leaves nothing sends nothing: ErrNoConnection), set in their own
// transaction in the same round trip. A bound the client alone keeps (a context deadline) is
// ambiguous: the server goes on with the statement until the cancel
// request reaches it, and may commit it after the caller was told it
// failed. The server's own timeout ends it first, and an error means
// nothing was written. Not part of Executor: the Publisher looks for it.
func (e pgxPool) BoundedByServer(d time.Duration) Executor {
	return serverBounded{pool: e.pool, defs: e.defs, timeout: d}
}

// boundLeft is the statement_timeout of a statement bounded by the server
// whose bound d began at began: what the wait for a connection left of d.
// The client waits a moment longer than d from then (the Publisher's
// context), and its bound must not fire first: a statement it gives up on
// may yet commit, and its error could not say that nothing was written.
// ok is false when under a millisecond is left.
func boundLeft(d time.Duration, began time.Time) (timeout string, ok bool) {
	left := d - time.Since(began)
	if left < time.Millisecond {
		return "", false
	}
	return fmt.Sprintf("%dms", left.Milliseconds()), true
}

// lateConnection is ErrNoConnection for a connection that came after the
// wait for it had used up the statement's bound: nothing was sent.
func lateConnection(inUse, most int, waited time.Duration) error {
	return fmt.Errorf("%w: one came after %s, too late for the statement's bound (%d of %d in use: transactions or handlers hold them, or statements waiting on the server, "+
		"behind a lock on the outbox or a server that does not answer; for the first, give the pool more connections, or publish in the transaction that holds one)",
		ErrNoConnection, waited.Round(time.Millisecond), inUse, most)
}

// serverBounded runs each statement after a set_config of its
// statement_timeout, both in one batch: one implicit transaction, which
// commits at the batch's end.
type serverBounded struct {
	pool    *pgxpool.Pool
	defs    *poolDefaults
	timeout time.Duration
}

// setReadCommitted makes a batch's implicit transaction READ COMMITTED
// (see serverBounded.send). A SET of it applies to that transaction only.
const setReadCommitted = "SET transaction_isolation = 'read committed'"

func (e serverBounded) send(ctx context.Context, q string, args []any) (pgx.BatchResults, error) {
	// The connection first, on its own: a bound that passes while every
	// connection is taken wrote nothing, and says so.
	began := time.Now()
	conn, err := e.pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			st := e.pool.Stat()
			if st.AcquiredConns() < st.MaxConns() && st.ConstructingConns() > 0 {
				return nil, notMade(int(st.AcquiredConns()), int(st.MaxConns()), err)
			}
			return nil, noConnection(int(st.AcquiredConns()), int(st.MaxConns()), err)
		}
		return nil, mapErr(err)
	}
	timeout, ok := boundLeft(e.timeout, began)
	if !ok {
		st := e.pool.Stat()
		conn.Release()
		return nil, lateConnection(int(st.AcquiredConns()), int(st.MaxConns()), time.Since(began))
	}
	// READ COMMITTED, as the Subscriber's own statements: under a
	// REPEATABLE READ or SERIALIZABLE default (a role's, a database's),
	// an insert meeting a dedup key a competitor or a consumer had just
	// changed failed with a serialization error, where it has nothing to
	// protect. Queued until the first batch has read the default, then
	// only where it is another level: the common case pays nothing.
	iso := e.defs.isolation.Load()
	b := &pgx.Batch{}
	if iso != 1 {
		b.Queue(setReadCommitted)
	}
	if iso == 0 {
		b.Queue("SELECT current_setting('default_transaction_isolation') = 'read committed'")
	}
	b.Queue("SELECT set_config('statement_timeout', $1, true)", timeout)
	b.Queue(q, args...)
	br := pooledBatch{BatchResults: conn.SendBatch(ctx, b), conn: conn}
	err = nil
	if iso != 1 {
		_, err = br.Exec()
	}
	if err == nil && iso == 0 {
		var rc bool
		if err = br.QueryRow().Scan(&rc); err == nil {
			e.defs.isolation.Store(isolationKnown(rc))
		}
	}
	if err == nil {
		_, err = br.Exec()
	}
	if err != nil {
		_ = br.Close()
		return nil, outcomeUnknown(ctx, mapErr(err))
	}
	return br, nil
}

// pooledBatch is a batch's results that give their connection back to
// the pool when closed.
type pooledBatch struct {
	pgx.BatchResults
	conn *pgxpool.Conn
}

func (b pooledBatch) Close() error {
	err := b.BatchResults.Close()
	b.conn.Release()
	return err
}

// ErrNoConnection is the error of a statement bounded by the server
// (a Publish through a pool) that found no connection of the pool free
// before its bound: it never ran, nothing was written.
var ErrNoConnection = errors.New("pgoutbox: no connection of the pool came free in time, so nothing was written")

// ErrOutcomeUnknown is the error of a statement bounded by the server (a
// Publish through a pool) that was sent and got no answer before its
// client-side bound: the server or the path to it did not answer, and the
// statement may still run when it arrives (or ran, its reply lost).
// Whether it was written is unknown: publishing again with the same dedup
// key is safe either way; without one it may write the message twice.
var ErrOutcomeUnknown = errors.New("pgoutbox: the statement was sent and got no answer in time: whether it was written is unknown")

// ErrCommitUnanswered is Middleware's error when the COMMIT of a handler's
// transaction got no answer (the connection broke, the server crashed, or
// with pgx CommitTimeout passed): if it committed, the message is done
// and is not delivered again; if not, it is. It wraps ErrOutcomeUnknown,
// and pgoutbox.Redelivered accepts it: a poison copy would repeat a message
// that is done or coming back.
var ErrCommitUnanswered = fmt.Errorf("%w: the COMMIT of the handler's transaction got no answer", ErrOutcomeUnknown)

// outcomeUnknown marks err, of a statement sent under ctx, as
// ErrOutcomeUnknown when ctx ended before the answer: not when the bound
// passed before anything was sent (pgconn.SafeToRetry).
func outcomeUnknown(ctx context.Context, err error) error {
	if err == nil || ctx.Err() == nil || pgconn.SafeToRetry(err) || errors.Is(err, ErrNoConnection) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
}

// notMade is ErrNoConnection for a wait on a connection the pool was
// making: the server or the path to it does not answer new connections
// (the advice for a pool that handlers hold would mislead).
func notMade(inUse, most int, err error) error {
	return fmt.Errorf("%w: a new connection to the database was not made (%d of %d in use); the server or the network path to it does not answer new connections: %w", ErrNoConnection, inUse, most, err)
}

func noConnection(inUse, most int, err error) error {
	return fmt.Errorf("%w (%d of %d in use: transactions or handlers hold them, or statements waiting on the server, behind a lock on the outbox or a server that does not answer; "+
		"for the first, give the pool more connections, or publish in the transaction that holds one): %w", ErrNoConnection, inUse, most, err)
}

func (e serverBounded) Exec(ctx context.Context, q string, args ...any) (int64, error) {
	br, err := e.send(ctx, q, args)
	if err != nil {
		return 0, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr // the commit's outcome
	}
	if err != nil {
		return 0, outcomeUnknown(ctx, mapErr(err))
	}
	return tag.RowsAffected(), nil
}

func (e serverBounded) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	br, err := e.send(ctx, q, args)
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		return nil, outcomeUnknown(ctx, mapErr(err))
	}
	// The batch's implicit transaction ends with it, whatever was read.
	return &txRows{Rows: rows, finish: func(bool, error) error { return outcomeUnknown(ctx, mapErr(br.Close())) }}, nil
}

func (serverBounded) InTx() bool { return false }

// txRows are the rows of a statement that runs in a transaction of its
// own (serverBounded's batch, sqlServerBounded's transaction): Err, after
// the rows, reports the transaction's end too, and Close ends it.
type txRows struct {
	Rows
	finish func(readAll bool, rowsErr error) error // ends the transaction
	done   bool                                    // Next returned false
	closed bool
	err    error
}

func (r *txRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.done = true
	return false
}

func (r *txRows) end() error {
	if !r.closed {
		r.closed = true
		r.Rows.Close()
		r.err = r.finish(r.done, mapErr(r.Rows.Err()))
	}
	return r.err
}

func (r *txRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return mapErr(err)
	}
	if !r.done {
		return nil // not read to its end: the transaction's end is yet to come
	}
	return r.end()
}

func (r *txRows) Close() { _ = r.end() }
func (e pgxPool) begin(ctx context.Context, iso isolation) (Executor, func(context.Context) error, func(context.Context) error, error) {
	var opts pgx.TxOptions // no IsoLevel: the connection's default
	if iso == readCommitted {
		opts.IsoLevel = pgx.ReadCommitted
	}
	pt, err := e.pool.BeginTx(ctx, opts)
	if err != nil {
		return nil, nil, nil, err
	}
	t := &endingTx{Tx: pt}
	return pgxTx{t}, t.Commit, t.Rollback, nil
}

// endingTx is a transaction pgoutbox began on a pgx pool, which knows
// whether its Commit or Rollback was called: until then its connection is
// its own, and the connection's state tells whether a COMMIT or ROLLBACK
// statement ended it (endedBySQL); after, the pool may have given the
// connection to someone else.
type endingTx struct {
	pgx.Tx
	ended atomic.Bool
}

func (t *endingTx) Commit(ctx context.Context) error {
	t.ended.Store(true)
	return t.Tx.Commit(ctx)
}

func (t *endingTx) Rollback(ctx context.Context) error {
	t.ended.Store(true)
	return t.Tx.Rollback(ctx)
}

// nilHandle is the Executor of a nil handle: every statement returns an
// error that names it, where the handle would panic.
type nilHandle struct {
	from, handle string
	inTx         bool
}

func (n nilHandle) err() error {
	return fmt.Errorf("pgoutbox: tx.%s was given a nil %s; pass an open one", n.from, n.handle)
}
func (n nilHandle) Exec(context.Context, string, ...any) (int64, error) { return 0, n.err() }
func (n nilHandle) Query(context.Context, string, ...any) (Rows, error) { return nil, n.err() }
func (n nilHandle) InTx() bool                                          { return n.inTx }

// mapErr turns "this transaction is finished" from either driver into
// ErrTxDone, so callers get one error to branch on and a hint at the fix.
func mapErr(err error) error {
	if errors.Is(err, sql.ErrTxDone) || errors.Is(err, pgx.ErrTxClosed) {
		return fmt.Errorf("%w (%v)", ErrTxDone, err)
	}
	return err
}

// RunInTx runs fn in a transaction. When exec is already bound to the
// caller's transaction, fn runs in it and nothing is committed here. When
// exec owns a pool, a transaction is begun, committed if fn returns nil and
// rolled back otherwise. An Executor of another kind runs fn directly.
//
// The transaction it begins is READ COMMITTED whatever the database's or
// role's default_transaction_isolation: pgoutbox's statements are written
// for it (a row another transaction changed meanwhile is read anew, where
// REPEATABLE READ fails with a serialization error, as concurrent
// Subscribes binding one topic did). A nil exec is an error; fn does not
// run.
func RunInTx(ctx context.Context, exec Executor, fn func(Executor) error) (err error) {
	if exec == nil {
		return errors.New("pgoutbox: executor is nil; pass tx.FromPgxPool(pool) or another tx executor")
	}
	if fn == nil {
		return errors.New("pgoutbox: RunInTx was given a nil function; pass the function to run in the transaction")
	}
	b, ok := exec.(beginner)
	if exec.InTx() || !ok {
		return fn(exec)
	}
	txExec, commit, rollback, err := b.begin(ctx, readCommitted)
	if err != nil {
		return err
	}
	returned := false
	defer func() {
		// Rolled back when fn failed, and when it never returned (a panic
		// a caller recovers, runtime.Goexit): the connection, and the locks
		// taken in it, must not be kept for good.
		if err != nil || !returned {
			_ = rollback(context.WithoutCancel(ctx))
		}
	}()
	err = fn(txExec)
	returned = true
	if err != nil {
		return err
	}
	return commit(ctx)
}
