package pgoutbox

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// drain is the part of a subscription that stops it: claiming and handing
// out end, handlers get until the drain's end to answer, and the rows
// still out are released after it. Only the owner touches it.
type drain struct {
	stopping bool
	over     bool      // the drain ended: no verdict is waited for
	end      time.Time // when the drain ends; zero once it did
	// poolClosed: the pool was closed, nothing can be written any more
	// (pool_closed.go).
	poolClosed bool
}

// beginStop stops claiming and handing out, gives the buffer back, and
// starts the drain.
func (sub *subscription) beginStop() {
	sub.drain.stopping = true
	sub.events.signals.cancelStop()
	queued := sub.takeQueued()
	if sub.outlet.slots != nil {
		sub.outlet.slots.stopOffering() // a slot holding a message reports it unsent
	}
	sub.giveBack(append(append(queued, sub.hand.guard.takeParked()...), sub.hand.takeBuffer()...))
	if d := sub.hand.retry; d != nil && d.holdDone {
		// Not delivered again yet: given back in its place (its count
		// taken back if the retry's delivery was counted).
		sub.hand.retry = nil
		sub.giveBack([]*delivery{d})
	}
	if sub.cfg.DrainTimeout < 0 {
		sub.endDrain(false)
		return
	}
	sub.drain.end = time.Now().Add(sub.cfg.DrainTimeout)
}

// endDrain stops waiting for handlers: the rows still handed out go back
// (under their tokens), never deleted; a late Ack is ignored. Not a row
// whose handler returned and whose transaction is completing it
// (tx.Middleware, bounded by its CommitTimeout): given back now, the
// transaction's delete would find no lease and roll the finished work
// back, or the return would find the row gone. Its message's context
// ends (the transaction does not follow it; a Retry outside stops), and
// its verdict comes when the transaction ends: the subscription waits for
// it, and gives the row back then if the transaction rolled back.
//
// An operator must be able to tell from the logs that a deploy's Close
// sent messages back: when the drain timed out (not NoDrain, chosen), the
// handlers still running are logged once, at WARN.
func (sub *subscription) endDrain(timedOut bool) {
	sub.drain.over = true
	sub.abandonLost()
	running, completing := 0, 0
	for d := range sub.hand.rows {
		if d.state == handedOut && d.outcome.completingInTx() {
			// A slot's message, or the owner's own (MaxInFlight 1).
			completing++
			d.outcome.cancelMessage()
			if d.cancel != nil {
				d.cancel()
			}
			continue
		}
		if d.state == handedOut {
			running++
			sub.stopWatching(d)
			sub.endMessage(d)
			sub.hand.handed--
			sub.release(d)
		}
	}
	fields := watermill.LogFields{"event": "drain_timeout", "drain_timeout": sub.cfg.DrainTimeout.String(), "running": running, "completing_in_tx": completing}
	switch {
	case timedOut && running > 0:
		logWarn(sub.logger, "Stopping: handlers still running when the drain ended (DrainTimeout); their messages go back to the outbox and are delivered again, their late acks ignored (those completing in a transaction are waited for)", fields)
	case running+completing > 0:
		sub.logger.Debug("Stopping: the messages in flight go back to the outbox (NoDrain), or only transactions completing remain (waited for)", fields)
	}
}

// finalRetryEvery is how often Close tries its last writes again, at most,
// until their deadline.
const finalRetryEvery = 150 * time.Millisecond

// finishedStopping reports whether a stopping subscription may end: no
// handler to wait for, no claim under way, everything written, or the final
// writes given up on after their deadline.
func (sub *subscription) finishedStopping(now time.Time) bool {
	if sub.hand.handed > 0 || sub.claims.claiming || len(sub.held.batches) > 0 {
		return false
	}
	if sub.writes.finalDeadline.IsZero() {
		sub.writes.finalDeadline = now.Add(sub.cfg.StatementTimeout)
		sub.runners.completer.setDeadline(sub.writes.finalDeadline)
		sub.writes.gate.hurry(finalRetryEvery)
	}
	if sub.writes.inWrite {
		return false
	}
	if sub.drain.poolClosed {
		return true
	}
	if sub.writes.pending.empty() && !sub.claims.lost.due(now) && sub.hand.retry == nil && len(sub.writes.reacks) == 0 {
		return true
	}
	if sub.writes.finalFailures >= 3 || !now.Before(sub.writes.finalDeadline) {
		err := sub.writes.lastErr
		if err == nil {
			err = fmt.Errorf("no write completed within StatementTimeout (%s)", sub.cfg.StatementTimeout)
		}
		sub.logger.Error("Giving up writing acks and lease returns at close; those rows are redelivered when their leases expire", err,
			watermill.LogFields{"pending": sub.writes.pending.ops(), "writes_at_close": sub.writes.finalTries})
		return true
	}
	return false
}
