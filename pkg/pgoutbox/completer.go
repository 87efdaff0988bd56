package pgoutbox

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// maxPendingCompletions bounds the acks and nacks not yet written (pending
// or in the write under way) per subscription. A verdict frees its slot in
// the lease window as soon as it is recorded, so without a bound a
// completion path that cannot write (the database is down, or slow) would
// let claims lease ever more rows. With it, a subscription holds at most
// MaxInFlight + maxPrefetch + maxPendingCompletions leased rows, and a
// crashed process leaves at most MaxInFlight + maxPendingCompletions handled
// but unacked messages behind to be delivered again.
const maxPendingCompletions = 256

// completer is the completion path of one subscription: it records verdicts
// in memory at once and writes them in batches, one statement per batch,
// every row matched on its lease token (query.Complete, query.Dead). It also
// renews the leases of the rows the subscription holds every Lease/2
// (query.Renew), and gives back prefetched rows that waited half a lease
// without being handed out. One goroutine does all of it, so a renewal
// never races a completion of the same subscription.
type completer struct {
	sub *subscription

	mu       sync.Mutex
	room     *sync.Cond          // signalled when a write is over
	writing  int                 // acks and returns in the write under way
	draining bool                // the drain is over: stop applying backpressure
	inflight map[int64]*delivery // leased by us, completion not yet written
	acks     []*delivery
	returns  []returnOp
	dead     []deadOp

	kick         chan struct{}
	closing      chan struct{}
	done         chan struct{}
	deadline     time.Time // set for the final flush: bounds every statement of it
	renewFailing bool      // the last renewal failed (log the first failure only)
}

// returnOp gives a row back: a nack (due again after delay) or a release at
// shutdown (due again at once, keeping its place).
type returnOp struct {
	d     *delivery
	delay pgtype.Int8 // invalid: keep available_at
	undo  int32       // 1: the row was never handed out, take its delivery back
	err   pgtype.Text // invalid: keep last_error
	meta  pgtype.Text // invalid: keep metadata
}

type deadOp struct {
	d      *delivery
	reason string
	err    pgtype.Text
}

func newCompleter(sub *subscription) *completer {
	c := &completer{
		sub:      sub,
		inflight: map[int64]*delivery{},
		kick:     make(chan struct{}, 1),
		closing:  make(chan struct{}),
		done:     make(chan struct{}),
	}
	c.room = sync.NewCond(&c.mu)
	return c
}

// waitRoom blocks, with c.mu held, while the pending verdicts are at their
// bound (see maxPendingCompletions), unless the drain is over.
func (c *completer) waitRoom() {
	for len(c.acks)+len(c.returns)+c.writing >= maxPendingCompletions && !c.draining {
		c.signal()
		c.room.Wait()
	}
}

// stopBackpressure lets verdicts in without bound, so workers never block
// once the drain is over and the subscription winds down.
func (c *completer) stopBackpressure() {
	c.mu.Lock()
	c.draining = true
	c.mu.Unlock()
	c.room.Broadcast()
}

func (c *completer) track(ds []*delivery) {
	c.mu.Lock()
	for _, d := range ds {
		c.inflight[d.id] = d
	}
	c.mu.Unlock()
}

func (c *completer) signal() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

func (c *completer) ack(d *delivery) {
	c.mu.Lock()
	c.waitRoom()
	c.acks = append(c.acks, d)
	c.mu.Unlock()
	c.signal()
}

func (c *completer) retry(d *delivery, after time.Duration, errText string, meta []byte) {
	op := returnOp{d: d, delay: pgtype.Int8{Int64: max(after, 0).Microseconds(), Valid: true}}
	if errText != "" {
		op.err = pgtype.Text{String: errText, Valid: true}
	}
	if meta != nil {
		op.meta = pgtype.Text{String: string(meta), Valid: true}
	}
	c.push(op, true)
}

func (c *completer) release(d *delivery, undo bool) {
	op := returnOp{d: d}
	if undo {
		op.undo = 1
	}
	c.push(op, false)
}

func (c *completer) push(op returnOp, wait bool) {
	c.mu.Lock()
	if wait {
		c.waitRoom()
	}
	c.returns = append(c.returns, op)
	c.mu.Unlock()
	c.signal()
}

func (c *completer) deadLetter(d *delivery, reason, errText string) {
	op := deadOp{d: d, reason: reason}
	if errText != "" {
		op.err = pgtype.Text{String: boundError(errText), Valid: true}
	}
	c.mu.Lock()
	c.dead = append(c.dead, op)
	c.mu.Unlock()
	c.signal()
}

// close writes everything pending and stops the goroutine.
func (c *completer) close() {
	close(c.closing)
	<-c.done
}

func (c *completer) run() {
	defer close(c.done)
	renew := time.NewTicker(c.sub.cfg.Lease / 2)
	defer renew.Stop()
	bo := newBackoff()
	var retry <-chan time.Time      // set while backing off after a failed write
	var renewRetry <-chan time.Time // set after a failed renewal
	for {
		kick := c.kick
		if retry != nil {
			kick = nil // new verdicts wait for the retry, not hammer a failing database
		}
		select {
		case <-kick:
		case <-retry:
			retry = nil
		case <-renew.C:
			renewRetry = c.renewOrRetry()
			continue
		case <-renewRetry:
			renewRetry = c.renewOrRetry()
			continue
		case <-c.closing:
			c.finalFlush()
			return
		}
		// One batch per turn, so renewals get their turn under heavy load.
		if err := c.flushOnce(); err != nil {
			wait := bo.NextBackOff()
			c.sub.logger.Error("Writing acks and lease returns failed; retrying", err, watermill.LogFields{"retry_in": wait.String()})
			retry = time.After(wait)
			continue
		}
		bo.Reset()
		if c.hasPending() {
			c.signal()
		}
	}
}

type batch struct {
	acks    []*delivery
	returns []returnOp
	dead    []deadOp
}

func (b *batch) empty() bool { return len(b.acks)+len(b.returns)+len(b.dead) == 0 }

func (c *completer) hasPending() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.acks)+len(c.returns)+len(c.dead) > 0
}

// take hands the pending verdicts to a write. They still count against the
// backpressure bound until the write is over (doneWriting).
func (c *completer) take() batch {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := batch{acks: c.acks, returns: c.returns, dead: c.dead}
	c.acks, c.returns, c.dead = nil, nil, nil
	c.writing = len(b.acks) + len(b.returns)
	return b
}

// doneWriting puts back what the write left undone and frees the room of
// what it wrote.
func (c *completer) doneWriting(left batch) {
	c.mu.Lock()
	c.acks = append(left.acks, c.acks...)
	c.returns = append(left.returns, c.returns...)
	c.dead = append(left.dead, c.dead...)
	c.writing = 0
	c.mu.Unlock()
	c.room.Broadcast()
}

// flushOnce writes one batch of pending verdicts. On a database error the
// unwritten part stays pending for the next attempt.
func (c *completer) flushOnce() error {
	b := c.take()
	if b.empty() {
		c.doneWriting(b)
		return nil
	}
	err := c.write(&b)
	c.doneWriting(b)
	return err
}

// finalFlush writes what is pending at close, giving up after a few
// failures or one StatementTimeout in all, so Close stays bounded while the
// database is unreachable: those rows come back when their leases expire.
// Never lost, only redelivered.
func (c *completer) finalFlush() {
	bo := newBackoff()
	c.deadline = time.Now().Add(c.sub.cfg.StatementTimeout)
	for failures := 0; c.hasPending(); {
		err := c.flushOnce()
		if err == nil {
			continue
		}
		if failures++; failures >= 3 || time.Now().After(c.deadline) {
			c.sub.logger.Error("Giving up writing acks and lease returns at close; those rows are redelivered when their leases expire", err, nil)
			return
		}
		time.Sleep(bo.NextBackOff())
	}
}

// write runs the batch's statements; what was written is removed from b, so
// on error b holds only what is left to do.
//
// A statement that fails for good (bad data, a constraint, a changed table:
// see isPermanent) would fail again with the same rows, and hold up every
// ack behind it; so the batch is then written in parts, down to single
// rows, and a row whose own write cannot succeed is abandoned.
func (c *completer) write(b *batch) error {
	var err error
	if len(b.acks)+len(b.returns) > 0 {
		err = c.writeComplete(b.acks, b.returns)
		if err != nil && !isPermanent(err) {
			return err
		}
		if err != nil {
			writeAcks := func(x []*delivery) error { return c.writeComplete(x, nil) }
			if b.acks, err = writeEach(c, b.acks, func(d *delivery) *delivery { return d }, writeAcks); err != nil {
				return err
			}
			writeReturns := func(x []returnOp) error { return c.writeComplete(nil, x) }
			if b.returns, err = writeEach(c, b.returns, func(op returnOp) *delivery { return op.d }, writeReturns); err != nil {
				return err
			}
		}
		b.acks, b.returns = nil, nil
	}
	if len(b.dead) > 0 {
		if b.dead, err = writeEach(c, b.dead, func(op deadOp) *delivery { return op.d }, c.writeDead); err != nil {
			return err
		}
	}
	return nil
}

// writeEach writes items together and, if that fails for good, one at a
// time, abandoning an item whose own write fails for good. After a
// transient failure it returns the items still to write.
func writeEach[T any](c *completer, items []T, row func(T) *delivery, write func([]T) error) ([]T, error) {
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
			c.abandon(row(it), err)
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

// abandon gives up writing d's verdict: it is logged, no longer renewed, and
// comes back to some consumer when its lease expires. Never deleted.
func (c *completer) abandon(d *delivery, err error) {
	c.untrack(1, func(int) *delivery { return d })
	d.lost.Store(true)
	c.sub.logger.Error("Cannot write this row's ack, nack or dead-letter move; it comes back when its lease expires", err,
		watermill.LogFields{"event": "write_abandoned", "row_id": d.id, "topic": c.sub.topic, "deliveries": d.deliveries})
}

func (c *completer) stmtCtx() (context.Context, context.CancelFunc) {
	if !c.deadline.IsZero() {
		return context.WithDeadline(context.Background(), c.deadline)
	}
	return context.WithTimeout(context.Background(), c.sub.cfg.StatementTimeout)
}

func (c *completer) writeComplete(acks []*delivery, returns []returnOp) error {
	ackIDs, ackTokens := make([]int64, 0, len(acks)), make([]pgtype.UUID, 0, len(acks))
	for _, d := range acks {
		if !d.lost.Load() {
			ackIDs, ackTokens = append(ackIDs, d.id), append(ackTokens, d.token)
		}
	}
	n := len(returns)
	retIDs, retTokens := make([]int64, 0, n), make([]pgtype.UUID, 0, n)
	delays, undos := make([]pgtype.Int8, 0, n), make([]int32, 0, n)
	errs, metas := make([]pgtype.Text, 0, n), make([]pgtype.Text, 0, n)
	for _, op := range returns {
		if op.d.lost.Load() {
			continue
		}
		retIDs, retTokens = append(retIDs, op.d.id), append(retTokens, op.d.token)
		delays, undos = append(delays, op.delay), append(undos, op.undo)
		errs, metas = append(errs, op.err), append(metas, op.meta)
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	done, err := collectWritten(c.sub.s.pool.Query(ctx, c.sub.s.q.Complete, ackIDs, ackTokens, retIDs, retTokens, delays, undos, errs, metas))
	if err != nil {
		return err
	}
	c.untrack(len(acks), func(i int) *delivery { return acks[i] })
	c.untrack(len(returns), func(i int) *delivery { return returns[i].d })
	wakeFetch := false
	for _, d := range acks {
		if c.finish(d, done, "ack") {
			c.sub.s.obs.observe(Event{Kind: EventAcked, Topic: c.sub.topic, RowID: d.id, Deliveries: d.deliveries})
		}
	}
	for _, op := range returns {
		phase, kind := "release", EventReleased
		if op.delay.Valid {
			phase, kind, wakeFetch = "nack", EventRetried, true
		}
		if c.finish(op.d, done, phase) {
			c.sub.s.obs.observe(Event{Kind: kind, Topic: c.sub.topic, RowID: op.d.id, Deliveries: op.d.deliveries})
		}
	}
	if wakeFetch {
		// The fetch loop may be asleep for a whole poll interval; let it
		// look at when the returned rows are due.
		select {
		case c.sub.selfWake <- struct{}{}:
		default:
		}
	}
	return nil
}

func (c *completer) writeDead(ops []deadOp) error {
	n := len(ops)
	ids, tokens := make([]int64, 0, n), make([]pgtype.UUID, 0, n)
	reasons, errs := make([]string, 0, n), make([]pgtype.Text, 0, n)
	for _, op := range ops {
		if op.d.lost.Load() {
			continue
		}
		ids, tokens = append(ids, op.d.id), append(tokens, op.d.token)
		reasons, errs = append(reasons, op.reason), append(errs, op.err)
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	done, err := collectWritten(c.sub.s.pool.Query(ctx, c.sub.s.q.Dead, ids, tokens, reasons, errs))
	if err != nil {
		return err
	}
	c.untrack(len(ops), func(i int) *delivery { return ops[i].d })
	for _, op := range ops {
		if !c.finish(op.d, done, "dead_letter") {
			continue
		}
		fields := watermill.LogFields{"event": "dead_lettered", "reason": op.reason, "row_id": op.d.id,
			"topic": c.sub.topic, "deliveries": op.d.deliveries, "message_uuid": op.d.uuid, "last_error": op.err.String}
		if c.sub.s.q.Names.QDLQ == "" {
			c.sub.logger.Error("Message failed terminally and was deleted (no dead-letter table configured)", nil, fields)
		} else {
			c.sub.logger.Info("Message moved to the dead-letter table", fields)
		}
		c.sub.s.obs.observe(Event{Kind: EventDeadLettered, Topic: c.sub.topic, RowID: op.d.id, Deliveries: op.d.deliveries, Reason: op.reason})
	}
	return nil
}

// untrack removes written (or abandoned) deliveries from the in-flight set,
// under one lock for the whole batch. A row claimed again since keeps its
// newer entry.
func (c *completer) untrack(n int, at func(int) *delivery) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range n {
		if d := at(i); c.inflight[d.id] == d {
			delete(c.inflight, d.id)
		}
	}
}

// finish reports a lost lease for d if its write did not apply, and
// returns whether it applied. The caller untracked d.
func (c *completer) finish(d *delivery, done written, phase string) bool {
	if d.lost.Load() {
		return false // reported when it was found
	}
	if done.has(d) {
		return true
	}
	c.leaseLost(d, phase)
	return false
}

// leaseLost reports a row whose lease token no longer matches: its lease
// expired and another consumer claimed it (or an operator removed it). The
// write was not applied; the other holder completes the row.
func (c *completer) leaseLost(d *delivery, phase string) {
	d.lost.Store(true)
	logWarn(c.sub.logger, "Lease lost: the row was reclaimed by another consumer; this write was not applied", watermill.LogFields{
		"event": "lease_lost", "phase": phase, "row_id": d.id, "topic": c.sub.topic, "deliveries": d.deliveries,
	})
	c.sub.s.obs.observe(Event{Kind: EventLeaseLost, Topic: c.sub.topic, RowID: d.id, Deliveries: d.deliveries, Phase: phase})
}

// renewOrRetry renews, and after a failure returns a timer to try again
// soon: waiting a whole period would let the leases expire.
func (c *completer) renewOrRetry() <-chan time.Time {
	if c.renew() {
		return nil
	}
	return time.After(min(time.Second, c.sub.cfg.Lease/10))
}

// renew extends the leases of all rows this subscription holds, so a long
// handler does not lose its row to another consumer. It reports false when
// the renewal could not be written.
func (c *completer) renew() bool {
	c.mu.Lock()
	held := make([]*delivery, 0, len(c.inflight))
	var stale []*delivery
	now := time.Now()
	// If a prefetched row is still not handed out a renewal period after
	// its claim, the handlers are stuck or slow: give the whole buffer
	// back (all of it, so the rows keep their order) rather than hold it.
	stalled := false
	for _, d := range c.inflight {
		if d.state.Load() == buffered && now.Sub(d.claimedAt) > c.sub.cfg.Lease/2 {
			stalled = true
			break
		}
	}
	if stalled {
		// Before any row goes back: a claim pushing rows into the buffer
		// from now on gives them back too (claimOnce), and the fetch loop's
		// next claim scans from the start.
		c.sub.order.Lock()
		c.sub.rescan.Store(true)
		c.sub.order.Unlock()
	}
	for _, d := range c.inflight {
		switch {
		case d.lost.Load(), d.state.Load() == givenBack:
		case stalled && d.giveBack():
			stale = append(stale, d)
		default:
			held = append(held, d)
		}
	}
	c.mu.Unlock()
	for _, d := range stale {
		c.release(d, true)
	}
	if len(held) == 0 {
		return true
	}
	ids, tokens := make([]int64, len(held)), make([]pgtype.UUID, len(held))
	for i, d := range held {
		ids[i], tokens[i] = d.id, d.token
	}
	ctx, cancel := c.stmtCtx()
	defer cancel()
	start := time.Now()
	done, err := collectWritten(c.sub.s.pool.Query(ctx, c.sub.s.q.Renew, ids, tokens, c.sub.cfg.Lease.Microseconds()))
	if err != nil {
		// Once per outage at ERROR: the retry runs every second.
		if !c.renewFailing {
			c.sub.logger.Error("Renewing leases failed; retrying every second until it works", err, watermill.LogFields{"rows": len(held)})
		} else {
			c.sub.logger.Debug("Renewing leases failed again", watermill.LogFields{"rows": len(held), "err": err.Error()})
		}
		c.renewFailing = true
		return false
	}
	c.renewFailing = false
	for _, d := range held {
		if done.has(d) {
			d.leasedUntil(start.Add(c.sub.cfg.Lease))
		} else {
			c.leaseLost(d, "renew")
		}
	}
	c.sub.s.obs.observe(Event{Kind: EventLeaseRenewed, Topic: c.sub.topic, Count: len(done)})
	return true
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

func collectWritten(rows pgx.Rows, err error) (written, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	w := written{}
	for rows.Next() {
		var id int64
		var token pgtype.UUID
		if err := rows.Scan(&id, &token); err != nil {
			return nil, err
		}
		w[writtenKey{id, token.Bytes}] = true
	}
	return w, rows.Err()
}
