package pgoutbox

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgconn"
)

// writeQueue is the part of a subscription that feeds the completer: the
// verdicts and releases waiting to be written, whether a job is under way,
// the pacing of acks and the backoff after a failure, and the deadline of
// the last writes at close. Only the owner touches it.
type writeQueue struct {
	pending       writeJob   // not yet given to the completer
	inWrite       bool       // the completer has a job
	gate          retryGate  // after a failed write
	last          time.Time  // when the last write was started
	ackWait       time.Time  // a paced write of acks is due then
	finalDeadline time.Time  // set when only the last writes remain
	finalFailures int        // final writes in a row that could not reach the database (finalWriteFailed)
	finalTries    int        // writes started once only the last writes remained, for the log line that gives up
	lastErr       error      // the last write's failure, for the log line that gives up at close
	acked         recentAcks // the acks written lately, for a server that loses them (reackRecent)
	reacks        []ackedRow
	reacksUntil   time.Time // given up then: the rows' leases have ended anyway
}

// backpressured reports whether verdicts wait to be written in such numbers
// that the subscription should neither claim nor hand out more: a
// completion path that cannot write would otherwise let it lease ever more
// rows, and a crash would redeliver them all.
func (sub *subscription) backpressured() bool {
	return sub.writes.pending.ops()+sub.runners.completer.writing() >= maxPendingCompletions
}

// maxPendingCompletions bounds the verdicts not yet written per
// subscription: past it the owner neither claims nor hands out more. The
// slots still run what they hold (MaxInFlight + slotQueue), so a crashed
// process leaves at most that many more handled but unacked messages.
const maxPendingCompletions = 256

// startWrite hands the pending verdicts to the completer when it is free.
func (sub *subscription) startWrite(now time.Time) {
	if sub.writes.inWrite || sub.writes.gate.shut() {
		return
	}
	if sub.onlyFewAcks(now) && now.Sub(sub.writes.last) < ackPacing {
		sub.writes.ackWait = sub.writes.last.Add(ackPacing) // armTimer wakes us then
		return
	}
	sub.writes.ackWait, sub.writes.last = time.Time{}, now
	if !sub.writes.finalDeadline.IsZero() {
		sub.writes.finalTries++
	}
	job := sub.writes.pending
	if job.renew != nil {
		// The key of now, not of when the renewal was queued: the lock
		// may have been lost, or taken again, since.
		job.renewHolder = sub.holder()
	}
	job.releaseTokens = sub.claims.lost.releasable(now)
	if len(sub.writes.reacks) > 0 && (sub.drain.stopping || sub.holder().Valid) {
		// Once the liveness lock is held again: until then the server is
		// likely down. A stopping subscription tries them with its last
		// writes, within their deadline.
		job.reacks = sub.writes.reacks
	}
	if job.empty() && len(job.releaseTokens) == 0 && len(job.reacks) == 0 {
		return
	}
	sub.writes.pending = writeJob{}
	sub.writes.inWrite = true
	sub.runners.completer.submit(job)
}

// ackPacing spaces writes that carry only a few acks: written back to back
// they would cost a statement (and a commit) for a handful of rows each,
// and the database's CPU is what bounds a drain. Acks need no hurry (the
// handler is done; a verdict frees its slot at once); anything else is
// written at once.
const (
	ackPacing   = time.Millisecond
	ackBatchMin = 128
)

// onlyFewAcks reports whether the pending writes are acks alone, fewer
// than ackBatchMin, and nothing else waits.
func (sub *subscription) onlyFewAcks(now time.Time) bool {
	p := &sub.writes.pending
	return len(p.acks) < ackBatchMin && len(p.returns)+len(p.holds)+len(p.dead) == 0 &&
		p.renew == nil && !sub.claims.lost.due(now) && !sub.drain.stopping
}

// onWritten applies what the completer wrote: finished rows leave the
// owner's hands, lost leases are reported, the rest is retried.
func (sub *subscription) onWritten(r writeResult) {
	sub.writes.inWrite = false
	job := r.job
	writtenAt := time.Now()
	gone := 0 // acks written again that found their row gone (ackUnansweredGone)
	for _, d := range job.acks {
		if r.left.has(d) {
			continue // not written yet: stays pending
		}
		phase := "ack"
		if ackUnansweredGone(d, r) {
			phase = "ack_unanswered"
			gone++
		}
		if sub.finish(d, r, phase) {
			sub.s.obs.observe(Event{Kind: EventAcked, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathLease})
			if !sub.cfg.SynchronousCommit {
				sub.writes.ackWritten(ackedRow{id: d.id, token: d.token.Bytes, at: at(writtenAt)})
			}
		}
	}
	if gone > 0 {
		// One line for the write, not one per row: a connection cut
		// under a busy subscription leaves a whole batch of them.
		logWarn(sub.logger, "Acks written again, after the reply to the first was lost, found their rows gone: most likely the first "+
			"write had deleted them; if another consumer took them meanwhile (their lease ran out, or this process's liveness lock "+
			"went with its connection), those messages ran twice", watermill.LogFields{"event": "lease_lost", "phase": "ack_unanswered", "rows": gone})
	}
	sub.onReacked(r)
	for _, op := range job.returns {
		if r.left.has(op.d) {
			continue
		}
		if op.giveBack {
			sub.claims.givingBack--
		}
		phase, kind, path := "release", EventReleased, PathLease
		if op.delay.Valid {
			phase, kind, path = "nack", EventRetried, ""
		}
		if sub.finish(op.d, r, phase) {
			sub.s.obs.observe(Event{Kind: kind, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: op.d.id, Deliveries: op.d.deliveries, Path: path})
		}
	}
	for _, op := range job.holds {
		d := op.d
		if r.left.has(d) {
			continue
		}
		switch {
		case r.done.has(d):
			d.holdDone = true
			sub.stampsWritten(d.stamp) // a hold keeps the row's key, which may be gone by now
			d.expiresAt = at(r.sent).add(sub.cfg.Lease)
			if !op.countOnly {
				sub.s.obs.observe(Event{Kind: EventRetried, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries})
			}
			if sub.drain.stopping {
				sub.hand.retry = nil
				sub.giveBack([]*delivery{d})
			}
		default:
			if sub.hand.retry == d {
				sub.hand.retry = nil
			}
			sub.finish(d, r, "nack")
		}
	}
	for _, op := range job.dead {
		if r.left.has(op.d) {
			continue
		}
		if !sub.finish(op.d, r, "dead_letter") {
			continue
		}
		fields := watermill.LogFields{"event": "dead_lettered", "reason": op.reason, "row_id": op.d.id,
			"deliveries": op.d.deliveries, "message_uuid": op.d.uuid, "last_error": op.err.String}
		if sub.s.q.Names.QDLQ == "" {
			logWarn(sub.logger, "Message failed terminally and was parked in the outbox (no dead-letter table configured)", fields)
		} else {
			sub.logger.Info("Message moved to the dead-letter table", fields)
		}
		sub.s.obs.observe(Event{Kind: EventDeadLettered, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: op.d.id, Deliveries: op.d.deliveries, Reason: op.reason})
	}
	sub.onRenewed(job.renew, r)
	if len(job.releaseTokens) > 0 {
		// By when the write was sent: a release that ran before a lost
		// claim's deadline, answered after it, does not count as after it.
		at := r.sent
		if at.IsZero() {
			at = time.Now()
		}
		sub.onReleasedClaims(job.releaseTokens, r.releaseErr, at)
	}

	if r.err != nil {
		if unanswered(r.err) {
			for _, d := range r.left.acks {
				d.ackUnanswered = true
			}
		}
		// The unwritten rest goes first next time.
		sub.writes.pending = r.left.merge(sub.writes.pending)
		sub.writes.lastErr = r.err
		sub.finalWriteFailed(r.err)
		now := time.Now()
		wait := sub.writes.gate.failed(now)
		if conflict(r.err) && sub.writes.gate.failures <= quietConflicts {
			// As a claim's (see onClaimed): a row changed under the write,
			// moved by a rotation or a conversion; the retry sees it anew.
			sub.logger.Debug("Writing acks and lease returns met a row changed under it; retrying",
				watermill.LogFields{"retry_in": wait.String(), "err": r.err.Error()})
			return
		}
		fields := watermill.LogFields{"retry_in": wait.String(), "failures": sub.writes.gate.failures}
		if !sub.writes.gate.shouldLog(now) {
			sub.logger.Debug("Writing acks and lease returns failed; retrying", fields.Add(watermill.LogFields{"err": r.err.Error()}))
			return
		}
		sub.logger.Error("Writing acks and lease returns failed; retrying", logged(r.err), fields)
		return
	}
	// Only the release of lost claims, or the writing again of lost
	// acks, failed: retried after a backoff too, not at once in a loop.
	var alone error
	switch {
	case r.releaseErr != nil && len(sub.claims.lost.list) > 0:
		alone = r.releaseErr
	case r.reackErr != nil && len(sub.writes.reacks) > 0:
		alone = r.reackErr
	default:
		sub.writes.gate.succeeded()
		return
	}
	sub.writes.lastErr = alone
	sub.finalWriteFailed(alone)
	sub.writes.gate.failed(time.Now())
}

// finalWriteFailed counts the failed final writes (at close) in a row
// that could not reach the database: after a few, Close gives up before
// its deadline. Other failures are retried until the deadline: a
// connection the server ended (an idle one of the pool, terminated before
// Close) fails fast too, and giving up on it after three dropped every
// ack in flight, their messages redelivered although handled, with the
// database up.
func (sub *subscription) finalWriteFailed(err error) {
	switch {
	case !sub.drain.stopping || sub.writes.finalDeadline.IsZero():
	case errors.As(err, new(*pgconn.ConnectError)):
		sub.writes.finalFailures++
	default:
		sub.writes.finalFailures = 0
	}
}

// finish ends d's time in the owner's hands after its write, and reports
// whether the write applied; a write that did not apply is a lost lease,
// or a row abandoned because its write cannot succeed.
func (sub *subscription) finish(d *delivery, r writeResult, phase string) bool {
	sub.endRow(d)
	if err, ok := r.abandoned[d]; ok {
		sub.logger.Error("Cannot write this row's ack, nack or dead-letter move; it comes back when its lease expires", logged(err),
			watermill.LogFields{"event": "write_abandoned", "row_id": d.id, "deliveries": d.deliveries})
		return false
	}
	if r.done.has(d) {
		d.endFailed = false // the write it was set for applied: a later loss is its own
		return true
	}
	if d.endFailed {
		phase = "commit" // the lease it was written under never committed
	}
	sub.leaseLost(d, phase)
	return false
}

// ackUnansweredGone reports whether d's ack, written again after the reply
// to an earlier write of it was lost, missed a row that is gone (or that
// could not be looked up): the earlier write may have deleted it. A row
// still there is held by another consumer, or due again: a lease lost
// for sure.
func ackUnansweredGone(d *delivery, r writeResult) bool {
	_, abandoned := r.abandoned[d]
	return d.ackUnanswered && !r.done.has(d) && !abandoned && !r.present[d.id]
}

// unanswered reports whether a failed write may have been applied: it was
// sent and its reply never came (the connection went, its deadline
// passed). A write the server answered with an error, or one that never
// left (no connection, pgconn.SafeToRetry), applied nothing.
func unanswered(err error) bool {
	var pgErr *pgconn.PgError
	return !errors.As(err, &pgErr) && !errors.As(err, new(*poolWait)) &&
		!errors.As(err, new(*pgconn.ConnectError)) && !pgconn.SafeToRetry(err)
}

// dropLost ends a row someone else holds now (phase: what found out): it
// ends here, and nothing is written for it. A handed-out message's handler
// is told to stop.
func (sub *subscription) dropLost(d *delivery, phase string) {
	sub.leaseLost(d, phase)
	sub.endRow(d)
}

// leaseLost reports a row that is no longer ours: its lease token no longer
// matches (its lease expired and another consumer claimed it, or an
// operator removed it), or, phase "commit", the held transaction it was in
// did not commit. The write was not applied; the row is delivered again,
// here or elsewhere.
func (sub *subscription) leaseLost(d *delivery, phase string) {
	fields := watermill.LogFields{"event": "lease_lost", "phase": phase, "row_id": d.id, "deliveries": d.deliveries}
	switch phase {
	case "commit":
		// The batch's failure is logged once, with its counts (heldFailed):
		// a line per row made a lost connection print hundreds.
		sub.logger.Debug("A held batch did not commit (rolled back, or its reply was lost); this row is due again and is delivered again", fields)
	case "ack_unanswered":
		// Logged once for the write, with the count (onWritten).
		sub.logger.Debug("An ack written again, after the reply to the first was lost, found the row gone: "+
			"most likely the first had deleted it; else another consumer took it meanwhile, and it ran twice", fields)
	default:
		if d.outcome != nil && d.outcome.commitLost.Load() {
			// Most likely no lease lost: the handler's transaction
			// completed the row, and only the answer to its COMMIT was
			// lost. Its lease may have run out meanwhile all the same.
			sub.logger.Info("The nack found the row gone after the handler's COMMIT lost its answer: most likely that transaction committed after all "+
				"and the message is done; else its lease was lost (ran out, or a server crash lost the claim) and it is delivered again", fields)
		} else {
			logWarn(sub.logger, "Lease lost: the row was claimed again (its lease ran out, or a server crash lost the claim) or removed by an operator; this write was not applied", fields)
		}
	}
	sub.s.obs.observe(Event{Kind: EventLeaseLost, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Phase: phase})
}
