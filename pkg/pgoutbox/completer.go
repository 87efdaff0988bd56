package pgoutbox

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// completer writes a subscription's batches: acks, returns, holds and dead
// letters in one statement each (query.Complete, query.Dead), renewals
// (query.Renew) and releases of lost claims (query.ReleaseClaim). Every
// row is matched on its lease token. It keeps no state of the
// subscription: the owner submits a job, the completer writes it and sends
// back which (row, token) pairs were written. It reads only the immutable
// id and token of the deliveries it is given.
type completer struct {
	pool  *pgxpool.Pool
	q     *query.Queries
	cfg   *SubscriberConfig
	topic string
	// isolate: the database's default isolation is not READ COMMITTED
	// (see readCommitted).
	isolate bool

	jobs     chan writeJob
	results  chan<- report
	done     chan struct{}
	deadline atomic.Int64 // unix nanos; set for the final writes at close: bounds every statement
	inFlight atomic.Int64 // ops of the job under way, for the owner's backpressure bound
	keys     []writtenKey // collectWritten's staging buffer, reused
}

func newCompleter(pool *pgxpool.Pool, q *query.Queries, cfg *SubscriberConfig, topic string, isolate bool, results chan<- report) *completer {
	return &completer{
		isolate: isolate,
		pool:    pool,
		q:       q,
		cfg:     cfg,
		topic:   topic,
		jobs:    make(chan writeJob, 1),
		results: results,
		done:    make(chan struct{}),
	}
}

// submit hands a job to the completer; the owner submits one at a time.
func (c *completer) submit(j writeJob) {
	c.inFlight.Store(int64(j.ops()))
	c.jobs <- j
}

// writing is the number of operations of the job under way.
func (c *completer) writing() int { return int(c.inFlight.Load()) }

// setDeadline bounds every later statement by t (the final writes at close).
func (c *completer) setDeadline(t time.Time) { c.deadline.Store(t.UnixNano()) }

func (c *completer) start() { go c.run() }

func (c *completer) stop() {
	close(c.jobs)
	<-c.done
}

func (c *completer) run() {
	defer close(c.done)
	for j := range c.jobs {
		r := c.write(j)
		c.inFlight.Store(0)
		c.results <- report{write: &r}
	}
}

func (c *completer) stmtCtx() (context.Context, context.CancelFunc) {
	if d := c.deadline.Load(); d != 0 {
		return context.WithDeadline(context.Background(), time.Unix(0, d))
	}
	return context.WithTimeout(context.Background(), c.cfg.StatementTimeout)
}

// write runs the job's statements. On a transient error, what is not
// written yet is returned in left.
//
// A statement that fails for good (bad data, a constraint, a changed table:
// see isPermanent) would fail again with the same rows, and hold up every
// ack behind it; so the batch is then written in parts, down to single
// rows, and a row whose own write cannot succeed is abandoned.
func (c *completer) write(j writeJob) writeResult {
	r := writeResult{job: j, sent: time.Now(), done: make(written, j.ops())}
	fail := func(err error, left writeJob) writeResult {
		left.wakeGroup = j.wakeGroup // after the rows it follows
		r.err, r.left = err, left
		if len(j.releaseTokens) > 0 {
			r.releaseErr = err // not run: the claims stay to release
		}
		if len(j.reacks) > 0 {
			r.reackErr = err // not run either
		}
		return r
	}
	if j.ops()-len(j.dead) > 0 {
		err := c.writeComplete(j.acks, j.returns, j.holds, r.done)
		if err != nil && !isPermanent(err) {
			return fail(err, writeJob{acks: j.acks, returns: j.returns, holds: j.holds, dead: j.dead})
		}
		if err != nil {
			acks, err := writeEach(&r, j.acks, func(d *delivery) *delivery { return d },
				func(x []*delivery) error { return c.writeComplete(x, nil, nil, r.done) })
			if err != nil {
				return fail(err, writeJob{acks: acks, returns: j.returns, holds: j.holds, dead: j.dead})
			}
			returns, err := writeEach(&r, j.returns, func(op returnOp) *delivery { return op.d },
				func(x []returnOp) error { return c.writeComplete(nil, x, nil, r.done) })
			if err != nil {
				return fail(err, writeJob{returns: returns, holds: j.holds, dead: j.dead})
			}
			holds, err := writeEach(&r, j.holds, func(op holdOp) *delivery { return op.d },
				func(x []holdOp) error { return c.writeComplete(nil, nil, x, r.done) })
			if err != nil {
				return fail(err, writeJob{holds: holds, dead: j.dead})
			}
		}
	}
	r.present = c.presentOfMissed(j.acks, r)
	if len(j.dead) > 0 {
		dead, err := writeEach(&r, j.dead, func(op deadOp) *delivery { return op.d },
			func(x []deadOp) error { return c.writeDead(x, r.done) })
		if err != nil {
			return fail(err, writeJob{dead: dead})
		}
	}
	if j.renew != nil {
		r.renewSent, r.renewDone = time.Now(), make(written, len(j.renew))
		if err := c.writeRenew(j.renew, j.renewHolder, r.renewDone); err != nil {
			return fail(err, writeJob{})
		}
		r.renewed = true
	}
	if j.wakeGroup {
		// Its failure fails nothing: the others find the key at their poll.
		ctx, cancel := c.stmtCtx()
		_, _ = c.pool.Exec(ctx, "SELECT pg_notify($1, $2)", c.q.Names.Channel, query.GroupMark+c.topic+query.GroupMark+c.cfg.ConsumerGroup)
		cancel()
	}
	if len(j.reacks) > 0 {
		r.reacked, r.reackErr = c.writeReacks(j.reacks)
	}
	// Last, and its failure fails nothing else: the owner tries again with
	// its next job, and gives up once the rows' leases have expired anyway.
	if len(j.releaseTokens) > 0 {
		ctx, cancel := c.stmtCtx()
		r.releaseErr = execOwn(ctx, c.pool, c.isolate, c.q.ReleaseClaim, c.topic, j.releaseTokens, c.cfg.ConsumerGroup)
		cancel()
	}
	return r
}

// presentOfMissed looks up which of the acks that missed their row (no
// row under their token) still have one: a lease lost for sure, where a
// row that is gone may be the work of an earlier write of the same ack
// whose reply was lost (finish). Misses are rare: one look by primary
// key, and its failure only leaves them unlooked at.
func (c *completer) presentOfMissed(acks []*delivery, r writeResult) map[int64]bool {
	var missed []int64
	for _, d := range acks {
		if _, gave := r.abandoned[d]; !r.done.has(d) && !gave {
			missed = append(missed, d.id)
		}
	}
	if len(missed) == 0 {
		return nil
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	rows, err := c.pool.Query(ctx, c.q.Present, missed)
	present, err := collectIDs(rows, err)
	if err != nil {
		return nil
	}
	return present
}

// writeEach writes items together and, if that fails for good, one at a
// time, abandoning an item whose own write fails for good. After a
// transient failure it returns the items still to write.
func writeEach[T any](r *writeResult, items []T, row func(T) *delivery, write func([]T) error) ([]T, error) {
	if len(items) == 0 {
		return nil, nil
	}
	err := write(items)
	if err == nil {
		return nil, nil
	}
	if !isPermanent(err) {
		return items, err
	}
	for i, it := range items {
		switch err := write(items[i : i+1]); {
		case err == nil:
		case isPermanent(err):
			if r.abandoned == nil {
				r.abandoned = map[*delivery]error{}
			}
			r.abandoned[row(it)] = err
		default:
			return items[i:], err
		}
	}
	return nil, nil
}

// isPermanent reports whether a statement failed for a reason a retry of
// the same statement cannot cure: bad data (SQLSTATE class 22), a violated
// constraint (23) or a missing or changed table or column (42).
func isPermanent(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) < 2 {
		return false
	}
	switch pgErr.Code[:2] {
	case "22", "23", "42":
		return true
	}
	return false
}

func (c *completer) writeComplete(acks []*delivery, returns []returnOp, holds []holdOp, done written) error {
	a := query.CompleteArgs{
		AckIDs: make([]int64, len(acks)), AckTokens: make(query.Tokens, len(acks)),
		LeaseUS: c.cfg.Lease.Microseconds(), Channel: c.q.Names.Channel, WakeKey: c.topic + query.GroupMark + c.cfg.ConsumerGroup,
	}
	for i, d := range acks {
		a.AckIDs[i], a.AckTokens[i] = d.id, &d.token
	}
	if n := len(returns); n > 0 {
		a.RetIDs, a.RetTokens = make([]int64, n), make(query.Tokens, n)
		a.DelayUS, a.Undo = make([]pgtype.Int8, n), make([]int32, n)
		a.Errs, a.Metas = make([]pgtype.Text, n), make([]pgtype.Text, n)
		for i, op := range returns {
			a.RetIDs[i], a.RetTokens[i] = op.d.id, &op.d.token
			a.DelayUS[i], a.Undo[i], a.Errs[i], a.Metas[i] = op.delay, op.undo, op.err, op.meta
		}
	}
	if h := len(holds); h > 0 {
		a.HoldIDs, a.HoldTokens = make([]int64, h), make(query.Tokens, h)
		a.HoldErrs, a.HoldMetas = make([]pgtype.Text, h), make([]pgtype.Text, h)
		a.HoldCounts = make([]int32, h)
		for i, op := range holds {
			a.HoldIDs[i], a.HoldTokens[i], a.HoldErrs[i], a.HoldMetas[i] = op.d.id, &op.d.token, op.err, op.meta
			a.HoldCounts[i] = int32(op.d.deliveries) // the count the row has: nothing added
			if op.counts {
				a.HoldCounts[i]++ // the retry's delivery
			}
		}
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	stmt, args := c.q.Write(a)
	return c.writeStmt(ctx, done, stmt, args...)
}

func (c *completer) writeDead(ops []deadOp, done written) error {
	n := len(ops)
	ids, tokens := make([]int64, n), make(query.Tokens, n)
	reasons, errs := make([]string, n), make([]pgtype.Text, n)
	for i, op := range ops {
		ids[i], tokens[i], reasons[i], errs[i] = op.d.id, &op.d.token, op.reason, op.err
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	return c.writeStmt(ctx, done, c.q.Dead, ids, tokens, reasons, errs)
}

// writeReacks writes acks again (see reackRecent) and returns how many
// rows they deleted. Its failure fails nothing else: the owner tries again
// after a backoff (onWritten).
func (c *completer) writeReacks(queued []ackedRow) (int, error) {
	rows := lastOfEachRow(queued)
	tokens := make([]pgtype.UUID, len(rows))
	a := query.CompleteArgs{AckIDs: make([]int64, len(rows)), AckTokens: make(query.Tokens, len(rows))}
	for i := range rows {
		tokens[i] = pgtype.UUID{Bytes: rows[i].token, Valid: true}
		a.AckIDs[i], a.AckTokens[i] = rows[i].id, &tokens[i]
	}
	done := written{}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	stmt, args := c.q.Write(a)
	if err := c.writeStmt(ctx, done, stmt, args...); err != nil {
		return 0, err
	}
	return len(done), nil
}

func (c *completer) writeRenew(rows []*delivery, holder pgtype.Int8, done written) error {
	ids, tokens := make([]int64, len(rows)), make(query.Tokens, len(rows))
	for i, d := range rows {
		ids[i], tokens[i] = d.id, &d.token
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	return c.writeStmt(ctx, done, c.q.Renew, ids, tokens, c.cfg.Lease.Microseconds(), holder)
}

// written is the set of (row, lease) pairs a statement applied to. Keying
// by the token too matters: one batch may hold a stale and a current lease
// of the same row, and only the current one is written.
type written map[writtenKey]bool

type writtenKey struct {
	id    int64
	token [16]byte
}

func (w written) has(d *delivery) bool { return w[writtenKey{d.id, d.token.Bytes}] }

// collectWritten adds the (id, token) rows of a result to w.
// writeStmt runs a write statement after query.WriteSettings, in one round trip
// and one implicit transaction (a batch ends in one Sync), and records in
// w the (row, lease) pairs it applied to, once it committed: a statement
// that failed, or whose transaction did not commit, wrote nothing.
func (c *completer) writeStmt(ctx context.Context, w written, stmt string, args ...any) error {
	conn, err := acquire(ctx, c.pool)
	if err != nil {
		return err
	}
	defer conn.Release()
	b, lead := ownBatch(c.isolate, query.WriteSettings)
	b.Queue(stmt, args...)
	res := conn.SendBatch(ctx, b)
	if err := skipResults(res, lead); err != nil {
		_ = res.Close()
		return err
	}
	// The completer writes one job at a time: the staging buffer and the
	// scan targets are reused (Scan takes their addresses).
	got, err := c.scanWritten(res)
	defer func() { c.keys = got[:0] }()
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	for _, k := range got {
		w[k] = true
	}
	return nil
}

// scanWritten reads the (id, token) rows of a write statement into c.keys.
func (c *completer) scanWritten(res pgx.BatchResults) ([]writtenKey, error) {
	got := c.keys[:0]
	rows, err := res.Query()
	if err != nil {
		return got, err
	}
	defer rows.Close()
	var id int64
	var token pgtype.UUID
	dest := []any{&id, &token} // Scan's variadic list would be an allocation per row
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return got, err
		}
		if token.Valid {
			got = append(got, writtenKey{id, token.Bytes})
		}
	}
	return got, rows.Err()
}
