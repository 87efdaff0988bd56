package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// The held path (see ClaimMode): a claim locks its rows in a transaction
// the subscription keeps open on a pool connection while their handlers
// run. Acks are recorded in the batch and become that transaction's
// DELETE. Any other end of a row (a nack, a dead letter, a handler still
// running at the bound) makes the row an ordinary lease in that
// transaction; from then on it is a leased row like any other, and its
// write goes through the completer. Give-backs write nothing: the commit
// drops the lock. One statement and one commit per batch, where the lease
// path has two of each.

// heldBatch is the rows of one held claim. Only the owner touches it,
// except conn, which the claim and the finishing goroutine use in turn.
type heldBatch struct {
	conn      *pgxpool.Conn
	token     pgtype.UUID // the lease token of the rows that become leases
	rows      []*delivery
	undecided int // rows without a verdict or give-back yet
	claimedAt time.Time
	deadline  time.Time       // the bound: undecided rows become leases then
	closing   bool            // its finishing statement is under way
	deferred  writeJob        // writes of rows that become leases: after the commit that makes them so
	waiters   []chan struct{} // handlers' transactions waiting for this batch's end (unhold)
}

// heldFate is what the end of a held batch does with one of its rows.
type heldFate uint8

const (
	heldOpen     heldFate = iota // no decision yet: becomes a lease
	heldAcked                    // deleted in the batch's transaction
	heldReleased                 // given back: the commit drops its lock
	heldLeased                   // decided otherwise (nack, dead letter): becomes a lease, its write follows
)

// heldBound is how long a held transaction waits for the handlers of its
// batch before the rows still running become leases. Long enough for a
// busy batch to finish (a 256-row batch is handled in a few milliseconds),
// short enough that vacuum and the connection pool never notice.
const heldBound = 100 * time.Millisecond

// maxHeldBatches bounds a subscription's open held transactions (each on
// a pool connection). A claim that finds them all open waits a little for
// one to end (batchesBusy), then leases.
const maxHeldBatches = 3

// heldOffFor is how long ClaimAuto leases after it found the handlers slow.
const heldOffFor = 10 * time.Second

// bound is when the batch claimed at now ends at the latest.
func (sub *subscription) bound(now time.Time) time.Time {
	d := heldBound
	if sub.cfg.AckDeadline > 0 {
		d = min(d, sub.cfg.AckDeadline)
	}
	return now.Add(d)
}

// wantHeld decides whether a claim takes the held path.
func (sub *subscription) wantHeld(req claimRequest, now time.Time) bool {
	switch {
	case sub.cfg.ClaimMode == ClaimLease:
		return false
	case req.withExpired, req.orphansOf != nil, len(req.endedKeys) > 0:
		return false // reclaiming and ordering-key claims lease
	case req.window > 0 && (now.Before(sub.scan.keyedUntil) || sub.cfg.ClaimMode == ClaimAuto):
		// Keyed rows seen, or (ClaimAuto) a slow short claim, which may
		// have walked rows held back by keys a competitor holds: the held
		// claim has no window, and would walk them holding its locks.
		return false
	case now.Before(sub.heldFailedUntil):
		return false // see heldFailed
	case sub.cfg.ClaimMode == ClaimAuto && (sub.txSeen || now.Before(sub.heldOffUntil) || !sub.busy):
		// Idle claims (mostly empty) cost one statement as leases and two
		// round trips held; the first claim after a wake-up leases too.
		return false
	case len(sub.batches) >= maxHeldBatches:
		return false
	}
	// Leave the pool a connection for the completer and the user.
	st := sub.s.pool.Stat()
	return st.AcquiredConns()+2 <= st.MaxConns()
}

// runHeldClaim opens a held transaction and locks up to req.n ready rows
// in it. A transaction that locked nothing ends at once.
func (sub *subscription) runHeldClaim(req claimRequest) claimResult {
	r := claimResult{req: req}
	ctx, cancel := context.WithTimeout(context.Background(), sub.cfg.StatementTimeout)
	defer cancel()
	conn, err := sub.s.pool.Acquire(ctx)
	if err != nil {
		r.err = err
		return r
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	if !sub.cfg.SynchronousCommit {
		b.Queue("SET LOCAL synchronous_commit = off") // see SubscriberConfig.SynchronousCommit
	}
	// If this process stalls or its network vanishes while the batch is
	// held, the server ends the transaction after this long, and the rows
	// are due again: the held path's bound on how long rows stay locked,
	// where the lease path has Lease.
	b.Queue(fmt.Sprintf("SET LOCAL idle_in_transaction_session_timeout = %d", sub.heldIdleTimeout().Milliseconds()))
	b.Queue(sub.s.q.HeldClaim, sub.topic, req.n, sub.cfg.ConsumerGroup, req.at, req.id)
	res := conn.SendBatch(ctx, b)
	err = func() error {
		defer res.Close()
		for range b.Len() - 1 {
			if _, err := res.Exec(); err != nil {
				return err
			}
		}
		rows, err := res.Query()
		if err != nil {
			return err
		}
		for rows.Next() {
			d := &delivery{token: req.token}
			var uuid, key pgtype.Text
			var deliveries int32
			var createdAt time.Time
			if err := rows.Scan(&d.id, &uuid, &d.payload, &d.metaRaw, &deliveries, &d.availableAt, &key, &createdAt); err != nil {
				rows.Close()
				return err
			}
			d.uuid, d.deliveries, d.orderingKey, d.createdAt = uuid.String, int(deliveries), key.String, createdAt.UnixMicro()
			r.rows = append(r.rows, d)
		}
		rows.Close()
		return rows.Err()
	}()
	if err != nil {
		// A connection left inside a transaction is not reused: the pool
		// closes it, and the server rolls the transaction back.
		conn.Release()
		r.rows, r.err = nil, err
		return r
	}
	if len(r.rows) == 0 {
		r.took = time.Since(req.sent)
		_, err := conn.Exec(ctx, "ROLLBACK")
		if err != nil {
			conn.Conn().Close(ctx) //nolint:errcheck // closing is the way out
		}
		conn.Release()
		r.dueIn = sub.nextDue()
		return r
	}
	// ORDER BY with FOR UPDATE may return a row out of order when it was
	// changed while the claim waited for it (READ COMMITTED re-reads it).
	sortQueueOrder(r.rows)
	last := r.rows[len(r.rows)-1]
	r.cursorAt = pgtype.Timestamptz{Time: last.availableAt, Valid: true}
	r.cursor = pgtype.Int8{Int64: last.id, Valid: true}
	r.free = len(r.rows)
	r.batch = &heldBatch{conn: conn, token: req.token, rows: r.rows, undecided: len(r.rows)}
	r.took = time.Since(req.sent)
	return r
}

// decideHeld records how a held row ends; when every row of its batch is
// decided, the batch ends at the owner's next turn (tendBatches).
func (sub *subscription) decideHeld(d *delivery, f heldFate) {
	if d.fate == heldOpen {
		d.batch.undecided--
	}
	d.fate = f
}

// jobFor is where d's next write goes: the pending job, or, for a held
// row, the batch's deferred job, which joins the pending one once the
// batch's commit made the row a lease. Not before: a statement that starts
// before that commit reads the row as it was (no lease token) and would
// find nothing to write. An ordered subscription waits for that write (the
// retry of a nack), so its batch ends at once.
func (sub *subscription) jobFor(d *delivery) *writeJob {
	b := d.batch
	if b == nil {
		return &sub.pending
	}
	if !b.closing {
		sub.decideHeld(d, heldLeased)
		if sub.ordered() {
			b.deadline = time.Now()
		}
	}
	return &b.deferred
}

// heldAck records the ack of a held row: deleted in its batch's
// transaction, or, when the batch is ending, written as a lease's ack
// after that commit.
func (sub *subscription) heldAck(d *delivery) {
	if b := d.batch; b.closing {
		b.deferred.acks = append(b.deferred.acks, d)
		return
	}
	sub.decideHeld(d, heldAcked)
}

// tendBatches ends the held batches that are done or past their bound.
func (sub *subscription) tendBatches(now time.Time) {
	for _, b := range sub.batches {
		if b.closing {
			continue
		}
		switch {
		case b.undecided == 0:
			sub.closeBatch(b, now, "done")
		case !now.Before(b.deadline):
			sub.closeBatch(b, now, "bound")
		}
	}
}

// batchesBusy reports whether a claim should wait for a held batch to
// end: every batch is open and the oldest is young, so its rows are being
// handled and it ends soon. A claim that does not wait while batches are
// all open leases, at twice the cost per row; one that waits past a
// straggler would stall the subscription, hence the patience.
func (sub *subscription) batchesBusy(now time.Time) bool {
	if len(sub.batches) < maxHeldBatches || sub.cfg.ClaimMode == ClaimLease {
		return false
	}
	return now.Before(sub.batches[0].claimedAt.Add(heldPatience))
}

// heldPatience is how long a claim waits for a held batch to end (see
// batchesBusy): a few batches' handling time.
const heldPatience = 20 * time.Millisecond

// closeBatch ends a held batch: its acked rows are deleted, every row
// neither acked nor given back becomes a lease under the batch's token,
// and the transaction commits (on a goroutine; finishedBatch takes the
// result). The writes of the rows that become leases wait for that commit
// (jobFor).
func (sub *subscription) closeBatch(b *heldBatch, now time.Time, why string) {
	b.closing = true
	job := batchJob{b: b, holder: sub.holder()}
	for _, d := range b.rows {
		switch d.fate {
		case heldAcked:
			job.acks = append(job.acks, d)
		case heldReleased:
			job.released = append(job.released, d)
		default:
			if d.state == finished {
				continue
			}
			if d.fate == heldOpen {
				job.stragglers++
			}
			// Its lease ends Lease after the transaction began (now() in
			// HeldFinish), before the claim returned: expiresAt already says
			// claim + Lease.
			job.leased = append(job.leased, d)
		}
	}
	if why == "bound" && sub.cfg.ClaimMode == ClaimAuto && job.stragglers*2 > len(b.rows) {
		// Most handlers outlived the bound: they are slow, and a held row
		// that becomes a lease costs more than a lease alone.
		sub.heldOffUntil = now.Add(heldOffFor)
		sub.logger.Debug("Handlers slower than the held path's bound; leasing for a while", watermill.LogFields{
			"rows": len(b.rows), "still_running": job.stragglers, "lease_for": heldOffFor.String()})
	}
	if len(job.leased) > 0 {
		sub.logger.Trace("Held rows become leases", watermill.LogFields{"rows": len(job.leased), "reason": why})
	}
	go func() {
		r := sub.finishBatch(job)
		sub.reports <- report{batch: &r}
	}()
}

// batchJob is the end of a held batch.
type batchJob struct {
	b          *heldBatch
	acks       []*delivery
	released   []*delivery
	leased     []*delivery
	stragglers int
	holder     pgtype.Int8
}

// batchResult is what finishBatch did.
type batchResult struct {
	job batchJob
	err error
}

// finishBatch writes the end of a held batch and commits, in one round
// trip, then gives the connection back to the pool.
func (sub *subscription) finishBatch(job batchJob) batchResult {
	r := batchResult{job: job}
	conn := job.b.conn
	defer conn.Release() // a connection still in a transaction is closed, not reused
	ctx, cancel := sub.comp.stmtCtx()
	defer cancel()
	b := &pgx.Batch{}
	ackIDs := make([]int64, len(job.acks))
	for i, d := range job.acks {
		ackIDs[i] = d.id
	}
	if len(job.leased) == 0 {
		if len(ackIDs) > 0 {
			b.Queue(sub.s.q.HeldAck, ackIDs)
		}
	} else {
		leaseIDs := make([]int64, len(job.leased))
		for i, d := range job.leased {
			leaseIDs[i] = d.id
		}
		b.Queue(sub.s.q.HeldFinish, ackIDs, leaseIDs, job.b.token, sub.cfg.Lease.Microseconds(), sub.cfg.WorkerID, job.holder)
	}
	if len(job.released) > 0 {
		// Rows given back are due again at commit: wake the idle
		// subscribers of the group, as a lease's release does.
		b.Queue("SELECT pg_notify($1, $2)", sub.s.q.Names.Channel, query.GroupMark+sub.topic+query.GroupMark+sub.cfg.ConsumerGroup)
	}
	b.Queue("COMMIT")
	res := conn.SendBatch(ctx, b)
	for i := range b.Len() {
		tag, err := res.Exec()
		if err != nil {
			r.err = err
			break
		}
		if i == b.Len()-1 && tag.String() != "COMMIT" {
			r.err = errHeldRolledBack // the server answers ROLLBACK to the COMMIT of a failed transaction
		}
	}
	if err := res.Close(); err != nil && r.err == nil {
		r.err = err
	}
	return r
}

var errHeldRolledBack = rolledBackError{}

type rolledBackError struct{}

func (rolledBackError) Error() string { return "pgoutbox: the held transaction rolled back" }

// finishedBatch applies the end of a held batch. If the commit failed, the
// transaction rolled back: every row of the batch is as before the claim,
// due again at once, and nothing of the batch happened; the rows that were
// to become leases are lost to this subscription like any lost lease.
func (sub *subscription) finishedBatch(r batchResult) {
	b := r.job.b
	for i, x := range sub.batches {
		if x == b {
			sub.batches = append(sub.batches[:i], sub.batches[i+1:]...)
			break
		}
	}
	for _, w := range b.waiters {
		close(w)
	}
	for _, d := range r.job.leased {
		d.batch = nil // a lease now (or, if the commit failed, lost)
	}
	// The writes that waited for the rows to become leases. After a failed
	// commit they find no lease and say so.
	ok := r.err == nil
	if !ok {
		// Not the holds (ordered mode's nack, whose row the subscription
		// keeps): if the COMMIT applied after all, the release of the
		// batch's token (heldFailed) would take the row from under the
		// hold. The retry is lost with the batch.
		for _, op := range b.deferred.holds {
			sub.dropLost(op.d, "commit")
		}
		b.deferred.holds = nil
	}
	sub.pending = sub.pending.merge(b.deferred)
	if !ok {
		sub.heldFailed(r)
	}
	for _, d := range r.job.acks {
		sub.heldDone(d)
		if ok {
			sub.s.obs.observe(Event{Kind: EventAcked, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathHeld})
		} else {
			sub.leaseLost(d, "ack")
		}
	}
	for _, d := range r.job.released {
		sub.givingBack--
		sub.heldDone(d)
		sub.s.obs.observe(Event{Kind: EventReleased, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathHeld})
	}
	if ok {
		if n := len(r.job.leased); n > 0 {
			sub.s.obs.observe(Event{Kind: EventHeldToLease, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, Count: n})
		}
		return
	}
	for _, d := range r.job.leased {
		switch {
		case d.state == finished:
		case d.state == writing || (d.state == retrying && !d.holdDone):
			// Its write finds the lease missing and reports it.
		case d.state == handedOut && d.outcome.completingInTx():
			// The handler's transaction is deleting it; its verdict follows.
		default:
			sub.dropLost(d, "commit")
		}
	}
}

// heldFailed handles a held batch whose end did not commit. Most likely
// the transaction rolled back: every row of the batch is due again, ahead
// of rows claimed later, so those go back too when order matters, and a
// claim under way gives its rows back (gen). But the COMMIT may have been
// applied with its reply lost: then the rows that became leases hold the
// batch's token, and are released under it like a lost claim's. Claims
// lease for a while: if the rows make the end fail again and again (a
// trigger, a constraint), leases write them one by one, and count their
// deliveries.
func (sub *subscription) heldFailed(r batchResult) {
	now := time.Now()
	sub.logger.Error("Ending a held batch failed; its rows are due again (acked ones are delivered again)", r.err,
		watermill.LogFields{"acked": len(r.job.acks), "leased": len(r.job.leased)})
	sub.gen++
	sub.scan.restart(false)
	sub.wantClaim = true
	if sub.ordered() {
		sub.giveBack(sub.takeBuffer())
	}
	if len(r.job.leased) > 0 {
		sub.lostClaims = append(sub.lostClaims, claimToken{token: r.job.b.token, at: now})
		sub.givingBack++
	}
	sub.heldFailedUntil = now.Add(heldOffFor)
}

// heldIdleTimeout is idle_in_transaction_session_timeout for held
// transactions: the bound, plus time for the owner to end the batch.
func (sub *subscription) heldIdleTimeout() time.Duration {
	return heldBound + sub.cfg.StatementTimeout
}

// heldDone ends a held row that the batch's end acked or released.
func (sub *subscription) heldDone(d *delivery) {
	delete(sub.held, d)
	d.state, d.batch = finished, nil
	sub.keyEnded(d)
}

// unholder returns the function a held row's outcome calls when a
// handler's transaction is about to delete the row (tx.Middleware): the
// owner ends the batch at once, so that DELETE waits for one commit, not
// the bound. nil for a leased row.
func (sub *subscription) unholder(d *delivery) func() {
	if d.batch == nil {
		return nil
	}
	return func() {
		done := make(chan struct{})
		sub.verdicts.put(verdict{d: d, converted: done})
		// The handler's DELETE must start after the commit that makes the
		// row a lease: before it, it would not find the lease token.
		t := time.NewTimer(heldBound + sub.cfg.StatementTimeout)
		defer t.Stop()
		select {
		case <-done:
		case <-sub.done: // the subscription ended: the row was given back
		case <-t.C:
		}
	}
}

// unhold ends the batch of a held row at once, for a handler's
// transaction that waits (converted) to delete the row.
func (sub *subscription) unhold(v verdict) {
	sub.txSeen = true
	b := v.d.batch
	if b == nil {
		close(v.converted)
		return
	}
	b.waiters = append(b.waiters, v.converted)
	if !b.closing {
		sub.closeBatch(b, time.Now(), "transaction")
	}
}
