package pgoutbox

import (
	"errors"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// startClaim starts a claim when one is wanted and there is room.
func (sub *subscription) startClaim(now time.Time) {
	sub.aloneSettled(now)
	switch {
	case sub.claims.waiting(), sub.drain.stopping, sub.holdsRowsBack():
		return
	}
	if sub.held.batchesBusy(now) {
		return // a batch ends soon: claim on the held path then
	}
	keyed := now.Before(sub.claims.scan.keyedUntil) // keyed rows seen, not just a slow claim
	n := sub.claims.pf.claimSize(sub.hand.unjudged(), now, keyed)
	if n == 0 {
		return
	}
	req := sub.claims.start(n, now, sub.holder(), sub.events.signals.waiter.Spare)
	req.held = sub.held.wantHeld(req, now, sub.claims.scan.keyedUntil, sub.poolHasSpare)
	if req.held {
		req.n = min(req.n, max(maxHeldClaim, sub.cfg.MaxInFlight))
	}
	req.freshOnly = !req.held && sub.claimsFreshOnly()
	req.arrivals.after = arrivalsFrom(req, len(sub.held.batches))
	go func() {
		r := sub.runners.claimer.run(req)
		sub.events.reports <- report{claim: &r}
	}()
}

// holdsRowsBack reports whether the subscription itself keeps rows from its
// handlers for now: its verdicts wait to be written in such numbers
// (backpressured), a retry waits, or a row runs alone. It claims nothing
// then, and a buffer waiting meanwhile says nothing of its handlers.
func (sub *subscription) holdsRowsBack() bool {
	return sub.backpressured() || sub.hand.retry != nil || sub.isolating() || sub.awaitingAlone()
}

// noArrivals, as a claim's arrivals cursor, takes no arrivals.
const noArrivals = math.MaxInt64

// arrivalsFrom is the arrivals cursor of a claim. A lease claim moves the
// arrivals it takes into the outbox, and a give-back leaves them there,
// where claims take them before the arrivals published before them. While
// held batches of ours are open, their arrivals are locked and a lease
// claim skips them: if its rows were then given back (an ordered nack in
// a batch), they would overtake those. So it leaves arrivals to the held
// claims until the batches end.
func arrivalsFrom(req claimRequest, openBatches int) int64 {
	if !req.held && openBatches > 0 {
		return noArrivals
	}
	return req.arrivals.after
}

// holder is what this process's rows are stamped with: its liveness key
// while it holds the lock, else NULL (liveness unknown: lease expiry only).
func (sub *subscription) holder() pgtype.Int8 {
	key, live := sub.events.signals.waiter.Liveness()
	return pgtype.Int8{Int64: key, Valid: live && key != 0}
}

// poolHasSpare reports whether a held claim leaves the pool a connection
// for the completer and the user.
func (sub *subscription) poolHasSpare() bool {
	st := sub.s.pool.Stat()
	return st.AcquiredConns()+2 <= st.MaxConns()
}

// onClaimed takes a claim's rows into the buffer.
func (sub *subscription) onClaimed(r claimResult) {
	now := time.Now()
	if r.err != nil {
		wait := sub.claims.failed(r, now)
		if r.req.held && now.Sub(r.req.sent) >= slowClaim {
			sub.held.failedUntil = now.Add(heldOffFor) // held claims read no window (see claimSchedule.failed)
		}
		fields := watermill.LogFields{"retry_in": wait.String(), "path": r.req.path()}
		if conflict(r.err) && sub.claims.gate.failures <= quietConflicts {
			// A row the claim was about to take changed under it: the
			// rotation of a rotating outbox moved it, or a deadlock with an
			// operator's statement. The next claim sees the row as it is.
			sub.logger.Debug("Claim met a row changed under it; claiming again", fields.Add(watermill.LogFields{"err": r.err.Error()}))
			return
		}
		fields = fields.Add(watermill.LogFields{"failures": sub.claims.gate.failures})
		if !sub.claims.gate.shouldLog(now) {
			sub.logger.Debug("Claim failed; retrying", fields.Add(watermill.LogFields{"err": r.err.Error()}))
			return
		}
		sub.logger.Error("Claim failed; retrying", logged(r.err), fields)
		return
	}
	if r.arrivals.fanOutErr != nil {
		sub.logger.Error("Fanning out arrivals failed; the next claim fans them out again", r.arrivals.fanOutErr, nil)
	}
	if g := sub.claims.gate; g.failures > 0 && now.Sub(g.since) >= claimsBackAfter {
		// The errors were logged as they came (the first ones, then fewer):
		// say when they ended, so that an outage's length shows in the log.
		sub.logger.Info("Claims succeed again", watermill.LogFields{"failures": g.failures, "failing_for": now.Sub(g.since).Round(time.Millisecond).String(), "path": r.req.path()})
	}
	woke := sub.claims.succeeded(r)
	// A claim that left arrivals to open held batches (arrivalsFrom) says
	// nothing of what waits: not idle.
	withheld := r.req.arrivals.after == noArrivals && len(r.rows) == 0
	sub.held.busy = len(r.rows) > 0 || withheld && sub.held.busy
	sub.s.obs.observe(Event{Kind: EventClaimed, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, Count: len(r.rows), Path: r.req.path()})
	sub.claims.pf.claimed(r.rows)
	for _, d := range r.rows {
		d.claimedAt = at(r.req.sent)
		d.expiresAt = d.claimedAt.add(sub.cfg.Lease)
		d.batch = r.batch
		d.stamp = r.req.holder // held rows: set when their batch ends
		sub.hand.rows[d] = struct{}{}
	}
	if r.batch == nil && len(r.rows) > 0 {
		sub.stampsWritten(r.req.holder) // the lock may have been lost while the claim ran
	}
	if b := r.batch; b != nil {
		sub.held.opened(b, r.req.sent)
	}
	if sub.drain.stopping || r.req.gen != sub.claims.gen {
		// Stopping, or rows went back while this claim ran: these rows may
		// be newer than those, so they go back too, and the next claim
		// takes everything from the start, in order, asking again for the
		// keys this one asked for (their rows, given back, ask for theirs).
		sub.giveBack(r.rows)
		sub.claims.keys.askAgain(r)
		return
	}
	// A row that runs alone (runsAlone) is kept only with nothing ahead of
	// it: nothing out, buffered, or kept before it from this claim; and
	// nothing of the claim behind it. Kept behind others it was counted
	// while it waited (a claim counts its rows), and a crash of one of
	// them counted it again: a row that had crashed nothing reached
	// MaxDeliveries. Otherwise it goes back with the rest of the claim,
	// their delivery taken back, and claims wait until everything ahead is
	// answered and written (awaitingAlone): the next claim brings it first.
	ahead := sub.hand.handed > 0 || len(sub.hand.buffer) > 0 || sub.isolating()
	rest := false // the rest of the claim goes back
	var later []*delivery
	for _, d := range r.rows {
		switch {
		case sub.hand.guard.claimed(d) != nil: // parked: an earlier delivery of it is ours
		case rest:
			later = append(later, d)
		case sub.runsAlone(d) && ahead:
			later, rest = append(later, d), true
			sub.hand.alone.behind = true
		default:
			rest = sub.runsAlone(d)
			ahead = true
			sub.hand.buffer = append(sub.hand.buffer, d)
		}
	}
	if len(later) > 0 {
		sub.giveBack(later)
	}
	sub.claims.next(r, woke, now)
	if r.passed {
		// A row delivered before waits, left where it was (claimsFreshOnly):
		// it runs alone, so claims wait until what is out is answered and
		// written, and the next one scans from the start to bring it first.
		sub.hand.alone.behind = true
		sub.claims.passedDelivered(r)
		sub.logger.Debug("A message delivered before waits to run alone until the messages out are answered", watermill.LogFields{"handed_out": sub.hand.handed})
	}
	if withheld && !sub.claims.withheld {
		// Claim again, on the held path where it may, rather than sleep
		// the idle poll away while arrivals wait. Once: a claim that must
		// lease again would find the batches still open.
		sub.claims.want, sub.claims.idleUntil = true, time.Time{}
	}
	sub.claims.withheld = withheld
}

// onReleasedClaims applies the release of the lost claims of tokens.
func (sub *subscription) onReleasedClaims(tokens []pgtype.UUID, err error, now time.Time) {
	n := len(tokens)
	tries := sub.claims.releasedClaims(tokens, err, now)
	// While the server restarts every try fails: the 1st, 2nd, 4th, 8th...
	// failure is logged, not each.
	switch {
	case err == nil:
	case tries == 0: // every lost claim left was given up: its leases ended
		sub.logger.Info("Releasing the rows of a failed claim failed; given up, as their leases have ended and any claim takes them", watermill.LogFields{"claims": n, "error": err.Error()})
	case tries&(tries-1) == 0 && sub.claims.lost.logged.Take(now):
		sub.logger.Error("Releasing the rows of a failed claim failed; retrying", logged(err), watermill.LogFields{"claims": n, "tries": tries})
	default:
		sub.logger.Debug("Releasing the rows of a failed claim failed; retrying", watermill.LogFields{"claims": n, "tries": tries, "err": err.Error()})
	}
}

// keyEnded lets the next row of d's key be asked for (claimSchedule.keyEnded);
// while stopping, by the group's other subscribers (writeJob.wakeGroup).
func (sub *subscription) keyEnded(d *delivery) {
	switch {
	case d.orderingKey == "":
	case !sub.drain.stopping:
		sub.claims.keyEnded(d.orderingKey)
	case !sub.drain.poolClosed:
		sub.writes.pending.wakeGroup = true
	}
}

// claimsBackAfter is how long claims must have failed for their first
// success to be logged.
const claimsBackAfter = time.Second

// quietConflicts is how many claims in a row may fail on a conflict
// before the failures are logged as errors: one now and then is expected,
// a run of them is not.
const quietConflicts = 3

// conflict reports whether err is a serialization failure or a deadlock:
// the statement met a concurrent change, and running it again is the
// remedy.
func conflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}
