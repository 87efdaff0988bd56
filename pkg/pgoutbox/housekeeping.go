package pgoutbox

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// housekeeping is the part of a subscription that runs periodic checks:
// ack deadlines (MaxInFlight 1), stalled buffers, lease renewals; and
// keeps the lines it and the wake-ups log from repeating. Only the owner
// touches it.
type housekeeping struct {
	next         time.Time // the next check
	nextRenew    time.Time
	renewFailing bool // the last renewal failed: logged once per outage

	deadlineLines logbudget.Budget // AckDeadline's error lines (deadlineLine)
	deadlineQuiet int              // AckDeadline lines sent to the debug log since the last error line

	unseenArrivalsLogged time.Time // the last error line of arrivals this subscription cannot see (arrived)
}

// housekeepingEvery is the period of the owner's checks of renewals, ack
// deadlines and stalled buffers.
func housekeepingEvery(cfg *SubscriberConfig) time.Duration {
	d := min(time.Second, cfg.Lease/10)
	if cfg.AckDeadline > 0 {
		d = min(d, cfg.AckDeadline/10)
	}
	return max(d, 10*time.Millisecond)
}

// bufferPatience is how long the rows a subscription holds for its
// handlers may take them at the rate they answer lately. The buffer holds
// what they consumed in prefetchHorizon, so a buffer that would last many
// horizons means they turned slow, and a competitor may be idle beside rows
// held here (handlers that went from 1 ms to 2 s held a few hundred rows
// for half a lease, 15 s, while another consumer of the group had nothing
// to do). At most half a lease.
func bufferPatience(cfg *SubscriberConfig) time.Duration {
	return min(cfg.Lease/2, 25*prefetchHorizon)
}

// prefetchStalled reports whether the rows waiting for a handler (the
// owner's buffer and the slots' queue) would wait longer than
// bufferPatience at the rate the handlers answered lately, and one of them,
// or a handler, has waited that long already: a pause of all handlers
// shorter than that (a lock, a collection) keeps the buffer. A
// subscription that does not prefetch (MaxDeliveries) holds only what its
// free handlers take.
//
// Not while the owner itself holds rows back (its writes are behind or
// backing off, a retry or a row that runs alone waits): the handlers are
// not what is slow, and during a database outage competitors could not
// take the rows either, while giving them back would add their writes to
// the backlog at recovery.
func (sub *subscription) prefetchStalled(now time.Time) bool {
	pf := &sub.claims.pf
	if pf.disabled || sub.holdsRowsBack() || sub.writes.gate.shut() {
		return false
	}
	waiting := len(sub.hand.buffer)
	if sub.hand.ready != nil {
		waiting++
	}
	if sub.outlet.slots != nil {
		waiting += sub.outlet.slots.queued()
	}
	if waiting == 0 {
		return false
	}
	patience := bufferPatience(sub.cfg)
	pf.sample(now)
	if float64(waiting) <= pf.rate*patience.Seconds() {
		return false
	}
	oldest := sub.hand.oldestWaiting()
	return oldest != nil && at(now).since(oldest.claimedAt) > patience || sub.hand.oldestHandedOut(now) > patience
}

// housekeeping runs the periodic checks: ack deadlines, stalled buffers,
// lease renewals.
func (sub *subscription) housekeeping(now time.Time) {
	sub.writes.acked.trim(at(now))                          // an idle subscription keeps no acks
	if sub.cfg.AckDeadline > 0 && sub.outlet.slots == nil { // with slots, each slot keeps it
		for d := range sub.hand.rows {
			if d.state == handedOut && at(now).since(d.handedAt) >= sub.cfg.AckDeadline && !d.outcome.completingInTx() {
				sub.ackDeadlinePassed(d, d.msg)
			}
		}
		// A row lost while its handler runs left the rows, but the owner
		// still waits for that handler: the deadline bounds that wait too.
		if d := sub.hand.single; d != nil && d.state == finished && at(now).since(d.handedAt) >= sub.cfg.AckDeadline && !d.outcome.completingInTx() {
			sub.lostHandlerTimedOut(d)
		}
	}
	// A prefetched row still waiting half a lease after its claim means the
	// handlers are stuck or slow, and so does a buffer they no longer get
	// through in bufferPatience: give the whole buffer back (all of it, so
	// the rows keep their order) for other consumers, rather than hold it.
	stalled := sub.prefetchStalled(now)
	if oldest := sub.hand.oldestWaiting(); oldest != nil && (stalled || at(now).since(oldest.claimedAt) > sub.cfg.Lease/2) {
		sub.giveBack(sub.hand.takeBuffer())
	}
	if sub.outlet.slots != nil && sub.outlet.slots.queued() > 0 && (stalled || sub.hand.oldestHandedOut(now) > sub.cfg.Lease/2) {
		// The same for the slots' queue: what no slot took yet goes back.
		sub.giveBack(sub.takeQueued())
	}
	// A row stamped with another key than the one held now is renewed at
	// once: rows leased before the lock was held (the first claims after
	// Subscribe) carry none, so a crash would leave them to their lease;
	// rows stamped with a key this process no longer holds, or can no
	// longer confirm (its LISTEN connection dropped or went silent), look
	// orphaned to other processes a second after the lock went
	// (notifier.OrphanGrace), and would be claimed while their handlers
	// run here: renewed without a key, they wait for their lease.
	holder := sub.holder()
	for d := range sub.hand.rows {
		if renewable(d) && d.stamp != holder {
			sub.house.nextRenew = now
			break
		}
	}
	if !now.Before(sub.house.nextRenew) && sub.writes.pending.renew == nil {
		// Only the leases that would end before the round after next
		// begins, with a quarter lease to spare, and the rows to stamp
		// anew: a young lease is left alone (a write fewer), so a handler
		// shorter than a quarter lease never finds its row changed under
		// it, which a transactional handler under REPEATABLE READ would
		// fail on (TestTxMiddlewareOnARepeatableReadDatabase).
		due := at(now).add(sub.cfg.Lease/2 + sub.cfg.Lease/4)
		var rows []*delivery
		for d := range sub.hand.rows {
			if renewable(d) && (d.stamp != holder || d.expiresAt < due) {
				rows = append(rows, d)
			}
		}
		if len(rows) > 0 {
			sub.writes.pending.renew, sub.writes.pending.renewHolder = rows, holder
		}
		sub.house.nextRenew = now.Add(sub.cfg.Lease / 2)
	}
}

// renewable reports whether d's lease is renewed. Rows with a write
// pending are left out: the write ends the lease (or keeps it, a hold),
// and a renewal after it in the same batch would find the row gone and
// call it lost. Held rows have no lease to renew.
func renewable(d *delivery) bool {
	return d.state != writing && !(d.state == retrying && !d.holdDone) && d.batch == nil
}

// stampsWritten runs the housekeeping at once when rows were just
// written with key h while the process holds another key, or none.
func (sub *subscription) stampsWritten(h pgtype.Int8) {
	if h != sub.holder() {
		sub.house.next = time.Now()
	}
}

// ackDeadlinePassed ends a delivery whose handler did not answer within
// AckDeadline: its context is cancelled, its lease no longer renewed, and
// the row nacked with a recorded error (a delivery, counted as such).
func (sub *subscription) ackDeadlinePassed(d *delivery, msg *message.Message) {
	sub.stopWatching(d)
	err := fmt.Errorf("%w: no ack or nack within %s", ErrAckDeadline, sub.cfg.AckDeadline)
	sub.logDeadline("Handler did not ack or nack within AckDeadline; the message is nacked and its context cancelled, and the next messages of its key (or of an ordered subscription) may run beside the handler if it does not return", err,
		watermill.LogFields{"event": "ack_deadline", "row_id": d.id, "deliveries": d.deliveries, "ack_deadline": sub.cfg.AckDeadline.String()})
	d.outcome.setErr(err)
	sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg}, true)
}

// logDeadline logs a line of a passed AckDeadline: as an error while the
// subscription's budget allows (deadlineLine), else at debug.
func (sub *subscription) logDeadline(line string, err error, fields watermill.LogFields) {
	if sub.house.deadlineLine(time.Now(), fields) {
		sub.logger.Error(line, err, fields)
		return
	}
	sub.logger.Debug(line, fields)
}

// deadlineLine reports whether an AckDeadline line of the subscription is
// logged as an error. One stalled call ends every delivery it holds at
// once (a relay's batch to a broker that hangs: hundreds of ERROR lines
// for one event), so after the budget's few lines a window they go to the
// debug log, and the next error line says how many did (fields'
// debug_lines_since).
func (h *housekeeping) deadlineLine(now time.Time, fields watermill.LogFields) bool {
	if !h.deadlineLines.Take(now) {
		h.deadlineQuiet++
		return false
	}
	if h.deadlineQuiet > 0 {
		fields["debug_lines_since"] = h.deadlineQuiet
		h.deadlineQuiet = 0
	}
	return true
}

// unseenArrivalsEvery is how often a subscription without Arrivals says
// that messages of its topic arrive where it does not look.
const unseenArrivalsEvery = time.Minute

// arrived acts on a publisher's wake-up saying that messages of the topic
// arrived in the arrivals table. Subscribe refuses a topic whose messages
// wait there (checkArrivals); this says so while the subscription runs,
// when publishers turned Arrivals on after it started (a deploy in the
// wrong order): its claims never read that table, and it would wait in
// silence while the messages pile up.
func (sub *subscription) arrived(now time.Time) {
	if sub.s.q.Names.Arrivals || now.Sub(sub.house.unseenArrivalsLogged) < unseenArrivalsEvery {
		return
	}
	sub.house.unseenArrivalsLogged = now
	sub.logger.Error("Messages of this topic arrive in the arrivals table, which this subscriber does not read: they wait until a subscriber with Arrivals takes them", ErrInvalidConfig,
		watermill.LogFields{"consumer_group": sub.cfg.ConsumerGroup, "arrivals_table": query.ArrivalsTableOf(sub.s.q.Names), "fix": "set Arrivals in the subscriber's schema.Config as in the publishers' (docs/arrivals.md), and restart it"})
}

// lostHandlerTimedOut stops waiting for the handler of a row lost while
// it ran (endRow), once AckDeadline has passed since its hand-out, as for
// a row still ours: what waited for it (the next message, ordered; the
// row claimed again) goes out beside it.
func (sub *subscription) lostHandlerTimedOut(d *delivery) {
	if _, lost := sub.hand.guard.lost[d]; lost || sub.hand.single == d {
		sub.logDeadline("Handler of a lost row did not return within AckDeadline; no longer waiting for it", ErrAckDeadline,
			watermill.LogFields{"event": "ack_deadline", "row_id": d.id, "ack_deadline": sub.cfg.AckDeadline.String()})
	}
	sub.answeredLate(d)
}

// onRenewed applies a renewal's result: extended leases, lost ones.
func (sub *subscription) onRenewed(rows []*delivery, r writeResult) {
	if rows == nil {
		return
	}
	if !r.renewed {
		// Once per outage at ERROR; retried within a second, not a period,
		// or the leases would expire meanwhile.
		if !sub.house.renewFailing {
			sub.logger.Error("Renewing leases failed; retrying every second until it works", logged(r.err), watermill.LogFields{"rows": len(rows)})
		}
		sub.house.renewFailing = true
		sub.house.nextRenew = time.Now().Add(min(time.Second, sub.cfg.Lease/10))
		return
	}
	sub.house.renewFailing = false
	renewed := 0
	for _, d := range rows {
		if d.state == finished {
			continue // ended while the renewal ran
		}
		if r.renewDone.has(d) {
			renewed++
			d.expiresAt = at(r.renewSent).add(sub.cfg.Lease)
			d.stamp = r.job.renewHolder
			if d.state == handedOut && d.outcome != nil {
				d.outcome.offerBy.Store(int64(d.expiresAt))
			}
			continue
		}
		if d.state == writing || (d.state == retrying && !d.holdDone) {
			continue // its pending write finds the lease lost and says so
		}
		if d.state == handedOut && d.outcome.completingInTx() {
			continue // the handler's transaction deleted it; its verdict follows
		}
		sub.dropLost(d, "renew")
	}
	sub.s.obs.observe(Event{Kind: EventLeaseRenewed, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, Count: renewed})
	sub.stampsWritten(r.job.renewHolder)
}

// lockChanged runs the housekeeping now when this process's liveness lock
// is lost or its confirmation ran out (notifier.OwnLockValidFor), so that
// rows stamped with it are renewed without a holder before other processes
// find the key missing for notifier.OrphanGrace; and when it is held again,
// so that they carry it again. Either may follow a server's crash, which
// loses the last acks (reackRecent).
func (sub *subscription) lockChanged(now time.Time) {
	sub.house.next = now
	sub.reackRecent(now) // the lock's connection may have gone with a crashed server
}
