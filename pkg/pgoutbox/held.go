package pgoutbox

import (
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
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

// heldPath is the held path's part of a subscription: its open batches
// and what decides whether a claim holds. Only the owner touches it.
type heldPath struct {
	batches     []*heldBatch // batches not ended yet, oldest first
	txSeen      bool         // a handler completed its row in its own transaction (ClaimAuto leases then)
	busy        bool         // the last claim found rows (ClaimAuto holds only then)
	offUntil    time.Time    // ClaimAuto leases until then: the handlers were slow
	failedUntil time.Time    // every mode leases until then: a batch's end failed
	forced      string       // a test's choice of claim path (internal/testhook), "" for none
	cfg         *SubscriberConfig
}

// heldBatch is the rows of one held claim. Only the owner touches it,
// except conn, which the claim and the finishing goroutine use in turn.
type heldBatch struct {
	conn      *pgxpool.Conn
	token     pgtype.UUID // the lease token of the rows that become leases
	rows      []*delivery
	undecided int // rows without a verdict or give-back yet
	claimedAt time.Time
	deadline  time.Time       // the bound: undecided rows become leases then
	endNow    bool            // end at the owner's next turn: an ordered retry waits for its write
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

// heldBoundOf is heldBound, or the bound a test forced for the
// subscriber (internal/testhook).
func heldBoundOf(cfg *SubscriberConfig) time.Duration {
	if d := testhook.HeldBound(cfg.WorkerID); d > 0 {
		return d
	}
	return heldBound
}

// maxHeldClaim caps a held claim (MaxInFlight when that is more): a crash
// rolls its batch back, handled rows too, and they run again, so a held
// batch stays at the size it had before lease claims grew to maxClaim:
// 3 × 256 rows at most come back from one subscription's open batches.
const maxHeldClaim = 256

// maxHeldBatches bounds a subscription's open held transactions (each on
// a pool connection). A claim that finds them all open waits a little for
// one to end (batchesBusy), then leases.
const maxHeldBatches = 3

// heldOffFor is how long ClaimAuto leases after it found the handlers slow.
const heldOffFor = 10 * time.Second

// bound is when the batch claimed at now ends at the latest.
func (h *heldPath) bound(now time.Time) time.Time {
	d := heldBoundOf(h.cfg)
	if h.cfg.AckDeadline > 0 {
		d = min(d, h.cfg.AckDeadline)
	}
	return now.Add(d)
}

// wantHeld decides whether a claim takes the held path; keyedUntil is when
// the subscription stops expecting keyed rows, spare whether the pool has
// a connection to keep for a batch.
func (h *heldPath) wantHeld(req claimRequest, now, keyedUntil time.Time, spare func() bool) bool {
	switch h.forced {
	case testhook.PathLease:
		return false
	case testhook.PathHeld:
		return len(h.batches) < maxHeldBatches && spare()
	}
	mode := h.cfg.ClaimMode
	busy := h.busy || h.forced == testhook.PathAutoBusy
	switch {
	case mode == ClaimLease:
		return false
	case h.cfg.MaxDeliveries > 0:
		// A held row's delivery is written only when its batch ends, so
		// a handler that crashes the process would never be counted.
		return false
	case req.withExpired(), req.orphansOf != nil, len(req.endedKeys) > 0:
		return false // reclaiming and ordering-key claims lease
	case req.window > 0 && (now.Before(keyedUntil) || mode == ClaimAuto && h.forced != testhook.PathAutoBusy):
		// Keyed rows seen, or (ClaimAuto) a slow short claim, which may
		// have walked rows held back by keys a competitor holds: the held
		// claim has no window, and would walk them holding its locks.
		return false
	case now.Before(h.failedUntil):
		return false // see heldFailed
	case mode == ClaimAuto && (h.txSeen || now.Before(h.offUntil) || !busy):
		// Idle claims (mostly empty) cost one statement as leases and two
		// round trips held; the first claim after a wake-up leases too.
		return false
	case len(h.batches) >= maxHeldBatches:
		return false
	}
	return spare()
}

// opened adds the batch of a held claim sent at sent.
func (h *heldPath) opened(b *heldBatch, sent time.Time) {
	b.claimedAt, b.deadline = sent, h.bound(sent)
	h.batches = append(h.batches, b)
}

// ended removes a batch whose end was written.
func (h *heldPath) ended(b *heldBatch) {
	for i, x := range h.batches {
		if x == b {
			h.batches = append(h.batches[:i], h.batches[i+1:]...)
			return
		}
	}
}

// nextEvent calls earliest with the times its batches need the owner at:
// their bounds, and the end of a claim's patience (batchesBusy).
func (h *heldPath) nextEvent(earliest func(time.Time)) {
	for _, b := range h.batches {
		if !b.closing {
			earliest(b.deadline)
		}
	}
	if len(h.batches) >= maxHeldBatches {
		earliest(h.batches[0].claimedAt.Add(heldPatience))
	}
}

// decide records how a held row ends; when every row of its batch is
// decided, the batch ends at the owner's next turn (tendBatches).
func (h *heldPath) decide(d *delivery, f heldFate) {
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
		return &sub.writes.pending
	}
	if !b.closing {
		sub.held.decide(d, heldLeased)
		if sub.ordered() {
			b.endNow = true
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
	sub.held.decide(d, heldAcked)
}

// tendBatches ends the held batches that are done or past their bound.
func (sub *subscription) tendBatches(now time.Time) {
	for _, b := range sub.held.batches {
		if b.closing {
			continue
		}
		switch {
		case b.undecided == 0:
			sub.closeBatch(b, now, "done")
		case b.endNow:
			sub.closeBatch(b, now, "retry")
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
func (h *heldPath) batchesBusy(now time.Time) bool {
	if len(h.batches) < maxHeldBatches || h.cfg.ClaimMode == ClaimLease {
		return false
	}
	return now.Before(h.batches[0].claimedAt.Add(heldPatience))
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
	job := sub.held.close(b, now, why, sub.holder())
	if job.slow {
		sub.logger.Debug("Handlers slower than the held path's bound; leasing for a while", watermill.LogFields{
			"rows": len(b.rows), "still_running": job.stragglers, "lease_for": heldOffFor.String()})
	}
	if len(job.leased) > 0 {
		sub.logger.Trace("Held rows become leases", watermill.LogFields{"rows": len(job.leased), "reason": why})
	}
	go func() {
		r := sub.runners.ender.end(job)
		sub.events.reports <- report{batch: &r}
	}()
}

// close decides the end of batch b: its acked rows are deleted, its
// released ones unlocked, every other row still ours becomes a lease. When
// most handlers outlived the bound (ClaimAuto), the handlers are slow, and
// a held row that becomes a lease costs more than a lease alone: the path
// leases for a while.
func (h *heldPath) close(b *heldBatch, now time.Time, why string, holder pgtype.Int8) batchJob {
	b.closing = true
	job := batchJob{b: b, holder: holder}
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
			if d.fate == heldOpen && d.state == handedOut {
				job.stragglers++ // a handler still running: buffered rows say nothing of their speed
			}
			// Its lease ends Lease after the transaction began (now() in
			// HeldFinish), before the claim returned: expiresAt already says
			// claim + Lease.
			job.leased = append(job.leased, d)
		}
	}
	if why == "bound" && h.cfg.ClaimMode == ClaimAuto && job.stragglers*2 > len(b.rows) {
		h.offUntil, job.slow = now.Add(heldOffFor), true
	}
	return job
}

// finishedBatch applies the end of a held batch. If the commit failed, the
// transaction rolled back: every row of the batch is as before the claim,
// due again at once, and nothing of the batch happened; the rows that were
// to become leases are lost to this subscription like any lost lease.
func (sub *subscription) finishedBatch(r batchResult) {
	b := r.job.b
	sub.held.ended(b)
	for _, w := range b.waiters {
		close(w)
	}
	for _, d := range r.job.leased {
		d.batch, d.arrival = nil, pgtype.TID{} // a lease in the outbox now (or, if the commit failed, lost)
		d.stamp = r.job.holder
	}
	if r.err == nil && len(r.job.leased) > 0 {
		sub.stampsWritten(r.job.holder)
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
	sub.writes.pending = sub.writes.pending.merge(b.deferred)
	if !ok {
		sub.heldFailed(r)
	}
	for _, d := range r.job.acks {
		sub.endRow(d)
		if ok {
			sub.s.obs.observe(Event{Kind: EventAcked, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathHeld})
		} else {
			sub.leaseLost(d, "commit") // its ack did not commit
		}
	}
	for _, d := range r.job.released {
		sub.claims.givingBack--
		sub.endRow(d)
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
			// Its write finds the lease missing and reports it, as this.
			d.endFailed = true
		case d.state == handedOut && d.outcome.completingInTx():
			// The handler's transaction is deleting it under the lease
			// that was most likely never made: it fails (tx.ErrLeaseLost),
			// and the nack that follows misses the lease too, as this. (If
			// the COMMIT applied with its reply lost, the DELETE finds the
			// lease and commits: nothing is written after it.)
			d.endFailed = true
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
	sub.logger.Error("Ending a held batch failed; its rows are due again (acked ones are delivered again)", logged(r.err),
		watermill.LogFields{"acked": len(r.job.acks), "leased": len(r.job.leased)})
	sub.claims.gaveBack()
	if sub.ordered() {
		sub.giveBack(sub.hand.takeBuffer())
	}
	if len(r.job.leased) > 0 {
		sub.claims.lostClaim(r.job.b.token, now)
	}
	sub.held.failedUntil = now.Add(heldOffFor)
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
		sub.events.inbox.putUnhold(unholdRequest{d: d, done: done})
		// The handler's DELETE must start after the commit that makes the
		// row a lease: before it, it would not find the lease token.
		t := time.NewTimer(heldBoundOf(sub.cfg) + sub.cfg.StatementTimeout)
		defer t.Stop()
		select {
		case <-done:
		case <-sub.events.signals.done: // the subscription ended: the row was given back
		case <-t.C:
		}
	}
}

// unhold ends the batch of a held row at once, for a handler's
// transaction that waits (r.done) to delete the row.
func (sub *subscription) unhold(r unholdRequest) {
	sub.held.txSeen = true
	b := r.d.batch
	if b == nil {
		close(r.done)
		return
	}
	b.waiters = append(b.waiters, r.done)
	if !b.closing {
		sub.closeBatch(b, time.Now(), "transaction")
	}
}

// heldMark ties a row of the held path to the batch whose transaction
// locks it (see held.go).
type heldMark struct {
	batch *heldBatch // nil: leased
	fate  heldFate   // how the batch's end treats the row
	// endFailed: the batch end that was to make the row a lease did not
	// commit, so the write waiting for that lease will miss it: a batch
	// that did not commit, not a lease another consumer took (finish).
	endFailed bool
}
