package pgoutbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
)

// claimer runs a subscription's claim statements, one at a time, on a
// goroutine of its own: it takes a claimRequest the owner fixed and returns
// a claimResult, and keeps no state of the subscription (like completer).
type claimer struct {
	pool  *pgxpool.Pool
	q     *query.Queries
	cfg   *SubscriberConfig
	topic string
	// isolate: the database's default isolation is not READ COMMITTED
	// (see readCommitted).
	isolate bool
	// stop ends when the subscription stops: reads that only plan
	// (nextDue) stop waiting for the database then.
	stop context.Context
}

// run claims on the path the request names.
func (c *claimer) run(req claimRequest) claimResult {
	var fannedOut int64
	var fanOutErr error
	claim := req
	if req.arrivals.fanOut {
		// A fan-out that fails changes nothing: the claim goes on, and the
		// next claim fans out again.
		fannedOut, fanOutErr = c.transfer(req.n)
		if fannedOut > 0 && c.cfg.MaxInFlight == 1 {
			// Its copies are due at their arrival, maybe behind the
			// cursor: an ordered subscription's claim reads from the
			// start, or it would take later rows before them.
			claim.from = queueCursor{at: scanFromStart}
		}
	}
	var r claimResult
	if claim.held {
		r = c.held(claim)
	} else {
		r = c.lease(claim)
	}
	// The request as the owner sent it: it moves its cursor to this
	// claim's only if it did not restart the scan meanwhile
	// (claimScan.claimed), here to the last row read from the start.
	r.req = req
	r.arrivals.fannedOut, r.arrivals.fanOutErr = fannedOut, fanOutErr
	return r
}

// transfer fans out arrivals that other groups have too (query.Arrivals
// Transfer), at least a claim's worth, in a statement of its own: the
// other groups' copies are theirs once it commits, whatever this claim
// does next. The claim that follows takes this group's copies.
func (c *claimer) transfer(n int) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatementTimeout)
	defer cancel()
	// The lock, then the fan-out: one round trip, one implicit
	// transaction (see query.ArrivalsStatements.TransferLock), with the
	// claims' settings: like a claim, the fan-out was planned anew on
	// every call otherwise.
	b, lead := ownBatch(c.isolate, query.ClaimSettings)
	b.Queue(c.q.Arrivals.TransferLock, c.topic)
	b.Queue(c.q.Arrivals.Transfer, c.topic, c.cfg.ConsumerGroup, max(n, maxClaim), c.q.Names.Channel)
	res := c.pool.SendBatch(ctx, b)
	defer res.Close()
	if err := skipResults(res, lead+1); err != nil {
		return 0, err
	}
	var moved, woken int64
	err := res.QueryRow().Scan(&moved, &woken)
	if err == nil {
		err = res.Close()
	}
	return moved, err
}

// lease leases up to req.n rows with the claim statement (query.Claim). It does not use the subscription's context: a
// claim cut off after the server ran it would leave rows leased that nobody
// knows of. After an empty claim it asks when the next row is due, so timers
// fire on time instead of at the next poll.
func (c *claimer) lease(req claimRequest) claimResult {
	r := claimResult{req: req}
	r.started = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.StatementTimeout)
	defer cancel()
	deadline := req.clock.deadline(r.started, c.cfg.StatementTimeout)
	if deadline.Valid {
		deadline.Time = deadline.Time.Add(-testhook.TakeClockStep(c.cfg.WorkerID))
	}
	stmt, args := c.q.Lease(query.ClaimArgs{
		Topic: c.topic, Group: c.cfg.ConsumerGroup, N: req.n, Token: req.token,
		LeaseUS: c.cfg.Lease.Microseconds(), WorkerID: c.cfg.WorkerID, Holder: req.holder,
		CursorAt: req.from.at, CursorID: req.from.id, ExpiredFrom: req.expiredFrom,
		Window: req.window, EndedKeys: req.endedKeys, Spare: req.orphansOf, Arrivals: req.arrivals.after,
		Deadline: deadline, FreshOnly: req.freshOnly,
	})
	// query.ClaimSettings, then the claim: one round trip, one implicit
	// transaction (a batch ends in one Sync), so the settings are the
	// claim's alone, and a claim the server fails rolls back and leaves
	// the connection idle. The whole batch runs whatever the client does
	// with the results: after a client-side error (a row that does not
	// scan) the rows are leased under the token, and the owner releases
	// them like a lost claim's.
	conn, err := acquire(ctx, c.pool)
	if err != nil {
		r.err = notSent{err}
		return r
	}
	defer conn.Release()
	b, lead := ownBatch(c.isolate, query.ClaimSettings)
	b.Queue(stmt, args...)
	b.Queue(query.ClaimDeadline, deadline)
	res := conn.SendBatch(ctx, b)
	defer res.Close()
	if err := skipResults(res, lead); err != nil {
		if pgconn.SafeToRetry(err) {
			err = notSent{err} // failed before anything was sent
		}
		r.err = claimErr(err)
		return r
	}
	rows, err := res.Query()
	if err != nil {
		r.err = claimErr(err)
		return r
	}
	r.clock.answeredAt = time.Now() // after the server's now(): see serverClock
	// Scan targets live outside the loop: Scan takes their addresses, and
	// per-row variables would each be an allocation per row.
	// So is the list of them: Scan's variadic slice would be one more
	// (each Scan gives the byte slices a new array, so they can be moved
	// into the delivery afterwards).
	var reclaimed, free int64
	var id pgtype.Int8
	var uuid, key pgtype.Text
	var payload, metaRaw []byte
	var deliveries pgtype.Int4
	var availableAt, createdAt pgtype.Timestamptz
	dest := []any{&id, &uuid, &payload, &metaRaw, &deliveries, &availableAt, &key, &createdAt}
	perRow := len(dest)
	var passed pgtype.Bool
	dest = append(dest, &r.last.at, &r.last.id, &reclaimed, &free, &r.clock.now, &r.clock.checkedAt, &passed)
	var arrivals pgtype.Int8
	var shared pgtype.Bool
	if c.q.Names.Arrivals {
		dest = append(dest, &arrivals, &shared)
	}
	var slab deliverySlab
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			rows.Close()
			r.err = err
			return r
		}
		// The cursor, the counts and the server's time are the
		// statement's, the same on every row: read once (pgx skips a nil
		// target).
		clear(dest[perRow:])
		if !id.Valid {
			continue // nothing claimed: the row only carries the cursor
		}
		d := slab.next()
		d.token, d.payload, d.metaRaw = req.token, payload, metaRaw
		d.id, d.uuid, d.deliveries = id.Int64, uuid.String, int(deliveries.Int32)
		d.availableAt, d.orderingKey, d.createdAt = availableAt.Time, key.String, createdAt.Time.UnixMicro()
		r.rows = append(r.rows, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		r.rows, r.err = nil, claimErr(err)
		return r
	}
	var endAt pgtype.Timestamptz
	if err := res.QueryRow().Scan(&endAt); err != nil {
		if late := r.clock.checkedAt.Time.Sub(deadline.Time); deadline.Valid && r.clock.checkedAt.Valid && late > 0 && len(r.rows) == 0 {
			// Late before it read a row: a clock stepped since the last
			// reading (lateClaim says so), and the next claim goes by
			// this one's.
			r.rows, r.err = nil, lateClaim{late: late}
			return r
		}
		// Its scans ran past the deadline: its readings of the clock,
		// taken before them, would put the server behind by their length.
		r.clock.checkedAt, r.clock.now = pgtype.Timestamptz{}, pgtype.Timestamptz{}
		r.rows, r.err = nil, claimErr(pastDeadline(err, c.cfg.StatementTimeout))
		return r
	}
	r.clock.checkedAt, r.clock.answeredAt = endAt, time.Now()
	if err := res.Close(); err != nil { // the commit's outcome
		r.rows, r.err = nil, claimErr(err)
		return r
	}
	r.reclaimed, r.free, r.passed = int(reclaimed), int(free), passed.Bool
	r.arrivals.last, r.arrivals.waiting = arrivals.Int64, shared.Bool
	// The checks below run on the claim's connection: taking a second one
	// while holding this one would deadlock subscriptions that share a
	// pool of as many connections as they are, all claiming at once (a
	// publish wakes every group of its topic).
	if err := c.verifyLeasedKeys(ctx, conn, &r); err != nil {
		// The rows stay leased under the claim's token: the owner releases
		// them like a lost claim's.
		r.rows, r.err = nil, err
		return r
	}

	sortQueueOrder(r.rows)        // RETURNING order is unspecified
	r.took = time.Since(req.sent) // the claim's own time (see claimScan.claimed)
	if len(r.rows) == 0 {
		r.dueIn = c.nextDue(conn)
	}
	return r
}

// verifyLeasedKeys gives back the keyed rows of a committed lease claim
// whose key turned out busy (query.KeyVerifyLease): of two claims of one
// key, the one that looks last sees the other's lease or key lock.
func (c *claimer) verifyLeasedKeys(ctx context.Context, conn *pgxpool.Conn, r *claimResult) error {
	ids := keyedIDs(r.rows)
	if ids == nil {
		return nil
	}
	// With the claim's settings, in one implicit transaction: its probes of
	// the keys must use the ordering-key index whatever the statistics say.
	b, lead := ownBatch(c.isolate, query.ClaimSettings)
	b.Queue(c.q.KeyVerifyLease, c.topic, ids, r.req.token, c.cfg.ConsumerGroup)
	res := conn.SendBatch(ctx, b)
	defer res.Close()
	if err := skipResults(res, lead); err != nil {
		return err
	}
	busy, err := collectIDs(res.Query())
	if err != nil {
		return err
	}
	r.rows, r.keyBusy = dropIDs(r.rows, busy), len(busy)
	return res.Close()
}

// keyedIDs returns the ids of the keyed rows, nil when there are none.
func keyedIDs(rows []*delivery) []int64 {
	var ids []int64
	for _, d := range rows {
		if d.orderingKey != "" {
			ids = append(ids, d.id)
		}
	}
	return ids
}

// collectIDs reads a result of ids.
func collectIDs(rows pgx.Rows, err error) (map[int64]bool, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	ids := map[int64]bool{}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids[id] = true
	}
	return ids, rows.Err()
}

// dropIDs removes the rows whose id is in drop, keeping the order.
func dropIDs(rows []*delivery, drop map[int64]bool) []*delivery {
	if len(drop) == 0 {
		return rows
	}
	kept := rows[:0]
	for _, d := range rows {
		if !drop[d.id] {
			kept = append(kept, d)
		}
	}
	return kept
}

// nextDue asks when the next row of the topic becomes claimable (a
// scheduled row or an expiring lease); 0 when none is, or on error. It
// runs on the claim's connection (see lease).
func (c *claimer) nextDue(conn *pgxpool.Conn) time.Duration {
	// It only plans: a stopping subscription does not wait for it.
	ctx, cancel := context.WithTimeout(c.stop, c.cfg.StatementTimeout)
	defer cancel()
	var us *int64
	if err := conn.QueryRow(ctx, c.q.NextDue, c.topic, c.cfg.ConsumerGroup).Scan(&us); err != nil || us == nil {
		return 0
	}
	// At least a millisecond: rounding must not make the loop spin on a
	// row that is due within a microsecond. At most maxDueIn: a row due
	// more than 292 years ahead (DeliverAt takes years up to 9999) is more
	// nanoseconds than a Duration holds, and the product wrapped to a wait
	// of a millisecond, an idle loop claiming 650 times a second.
	return max(time.Duration(min(*us, maxDueIn.Microseconds()))*time.Microsecond, time.Millisecond)
}

// maxDueIn bounds the wait nextDue reports: far longer than any poll
// interval, which wakes an idle loop before it anyway.
const maxDueIn = 24 * time.Hour
