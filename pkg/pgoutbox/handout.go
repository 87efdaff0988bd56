package pgoutbox

import (
	"bytes"
	"context"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/pgoutbox/watermill-pgoutbox/internal/handoff"
)

// handout is the part of a subscription that holds its rows: every row it
// leases or holds, the prefetch buffer, the prepared next message, what is
// handed out, and ordered mode's retry. Only the owner touches it.
type handout struct {
	rows   map[*delivery]struct{} // every row we lease or hold, in any state but finished
	buffer []*delivery            // claimed, not handed out, in queue order
	ready  *delivery              // taken from the buffer (or the retry) and prepared: goes out next
	single *delivery              // MaxInFlight 1: the message in flight, whose Ack the owner waits for itself
	handed int                    // handed out, waiting for a verdict
	retry  *delivery              // ordered mode: a nacked row delivered again at retryAt
	guard  rowGuard               // rows claimed again while an earlier delivery of theirs is ours
	alone  aloneRow               // MaxDeliveries: the redelivered row that runs with nothing beside it
}

// unjudged is the number of leased rows without a verdict: the lease window.
func (h *handout) unjudged() int {
	n := len(h.buffer) + h.handed + len(h.guard.parked)
	if h.ready != nil {
		n++
	}
	return n
}

// oldestWaiting is the prefetched row that waits longest for a handler:
// the prepared one, else the buffer's first; nil when none waits.
func (h *handout) oldestWaiting() *delivery {
	if h.ready == nil && len(h.buffer) > 0 {
		return h.buffer[0]
	}
	return h.ready
}

// takeBuffer empties the buffer, the prepared message first, in order.
func (h *handout) takeBuffer() []*delivery {
	buf := h.buffer
	if h.ready != nil {
		buf = append([]*delivery{h.ready}, buf...)
	}
	h.buffer, h.ready = nil, nil
	return buf
}

// nextMessage returns the delivery to hand out next, with the output
// channel to send it on, or a nil channel when nothing may go out now. Rows
// that must not go out (lease likely gone, too many deliveries,
// undecodable) are dealt with on the way.
func (sub *subscription) nextMessage(now time.Time) (*delivery, chan *message.Message) {
	if sub.drain.stopping || sub.backpressured() {
		return nil, nil
	}
	full := sub.hand.handed >= sub.maxHandedOut() || sub.hand.single != nil
	if d := sub.hand.retry; d != nil {
		if !d.holdDone || at(now) < d.retryAt || full {
			return nil, nil // ordered: nothing overtakes the retry
		}
		if !d.counted {
			// Counted when it goes out, as a claim counts a delivery
			// before its handler runs: a process that crashes in the
			// handler has it counted, one that crashed during the wait
			// has not (the claim that takes the row then counts it once).
			d.counted, d.holdDone = true, false
			job := sub.jobFor(d)
			job.holds = append(job.holds, holdOp{d: d, counts: true, countOnly: true})
			return nil, nil
		}
		if r := sub.hand.ready; r != nil { // prepared before the nack: back in front
			sub.hand.ready = nil
			sub.hand.buffer = append([]*delivery{r}, sub.hand.buffer...)
		}
		sub.hand.retry = nil
		d.state = buffered
		d.deliveries++ // the hold counted this delivery
		// A handler past its ack deadline may still hold the payload.
		d.payload = bytes.Clone(d.payload)
		d.claimedAt = at(now) // the stalled-buffer check measures from here
		if sub.prepare(d, now) {
			sub.hand.ready = d
		}
	}
	// The next message is prepared while the current one is in flight, so
	// a verdict is followed by the next hand-out at once.
	for sub.hand.ready == nil && len(sub.hand.buffer) > 0 {
		d := sub.hand.buffer[0]
		sub.hand.buffer[0] = nil
		sub.hand.buffer = sub.hand.buffer[1:]
		switch {
		case d.state == finished: // lease lost while buffered
		case d.msg != nil: // prepared already, then put back
			sub.hand.ready = d
		case sub.prepare(d, now):
			sub.hand.ready = d
		}
	}
	if sub.hand.ready == nil || full {
		return nil, nil
	}
	return sub.hand.ready, sub.outlet.out
}

// prepare admits d and builds its message (MaxInFlight 1: the owner hands
// it out itself), or sends d where it belongs instead and returns false.
func (sub *subscription) prepare(d *delivery, now time.Time) bool {
	if !sub.admit(d, now) {
		return false
	}
	d.outcome = sub.newOutcome(d)
	msg, cancel, err := buildMessage(sub.outlet.parent, d.uuid, d.payload, d.metaRaw, d.orderingKey, d.outcome)
	if err != nil {
		sub.poisoned(d, err)
		return false
	}
	d.msg, d.cancel = msg, cancel
	return true
}

// poisoned dead-letters a row that does not decode into a message.
func (sub *subscription) poisoned(d *delivery, err error) {
	sub.s.obs.observe(Event{Kind: EventPoisoned, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Err: err})
	sub.deadLetter(d, ReasonPoisoned, err.Error())
}

// messageParent is the parent of message contexts: the Subscribe context's
// values (a trace, a logger) without its cancellation. A Router cancels
// that context when it closes, and a handler mid-work must be let finish
// within DrainTimeout; the subscription cancels each message's context
// itself when its delivery ends, or when the drain does.
func messageParent(ctx context.Context) context.Context { return context.WithoutCancel(ctx) }

// buildMessage decodes a row into the message handed to the Router, with a
// context (derived from messageParent) that carries the outcome.
// It touches no subscription state: slots call it too.
func buildMessage(parent context.Context, uuid string, payload, metaRaw []byte, orderingKey string, o *outcome) (*message.Message, context.CancelFunc, error) {
	msg, err := decodeMessage(uuid, payload, metaRaw)
	if err != nil {
		return nil, nil, err
	}
	if orderingKey != "" {
		msg.Metadata[OrderingKeyMetadataKey] = orderingKey
	}
	ctx, cancel := context.WithCancel(handoff.With(parent, o))
	msg.SetContext(ctx)
	return msg, cancel, nil
}

// admit decides whether d may go out: false (and d sent where it belongs)
// when its lease is likely gone or it was delivered too often.
func (sub *subscription) admit(d *delivery, now time.Time) bool {
	// A row that waited while renewals could not reach the database may be
	// someone else's by now: give it back (under its token) rather than
	// risk two holders.
	if at(now).add(sub.cfg.StatementTimeout) >= d.expiresAt {
		back := []*delivery{d}
		if sub.ordered() {
			// Nothing may overtake it: everything behind goes back too.
			back = append(back, sub.hand.takeBuffer()...)
		}
		sub.giveBack(back)
		return false
	}
	if limit := sub.cfg.MaxDeliveries; limit > 0 && d.deliveries > limit {
		sub.deadLetter(d, ReasonMaxDeliveries, "")
		return false
	}
	return true
}

// handedOut records that the Router took d (MaxInFlight 1), or that a slot
// did (see dispatch). With one message in flight the owner waits for its
// verdict itself, one goroutine hop less per message.
func (sub *subscription) handedOut(d *delivery) {
	sub.hand.ready = nil
	d.state, d.handedAt = handedOut, at(time.Now())
	d.seq++
	sub.hand.handed++
	if sub.outlet.slots == nil {
		sub.hand.single = d
		sub.s.obs.handedOut(d.outcome)
		return
	}
	d.outcome, d.stopWatch = sub.newOutcome(d), make(chan struct{})
	d.outcome.offerBy.Store(int64(d.expiresAt))
	// Never blocks: see maxHandedOut.
	sub.outlet.slots.hand(slotItem{d: d, seq: d.seq, uuid: d.uuid, payload: d.payload, metaRaw: d.metaRaw, orderingKey: d.orderingKey,
		outcome: d.outcome, abandon: d.stopWatch})
}

// takeQueued takes back the deliveries in the slots' queue that no slot
// took yet, in queue order; they count as handed out no more.
func (sub *subscription) takeQueued() []*delivery {
	if sub.outlet.slots == nil {
		return nil
	}
	var out []*delivery
	for _, it := range sub.outlet.slots.takeQueued() {
		if it.d.state != handedOut || it.d.seq != it.seq {
			// Ended while queued (endRow counted it off): no slot will
			// answer for it now.
			sub.answeredLate(it.d)
			continue
		}
		it.d.state = buffered
		sub.hand.handed--
		out = append(out, it.d)
	}
	return out
}

// oldestHandedOut is how long ago the oldest delivery still handed out
// went to the slots.
func (h *handout) oldestHandedOut(now time.Time) time.Duration {
	var oldest time.Duration
	for d := range h.rows {
		if d.state == handedOut {
			oldest = max(oldest, at(now).since(d.handedAt))
		}
	}
	return oldest
}

// maxHandedOut bounds the deliveries given to the Router or to the slots.
// MaxInFlight slots send at most MaxInFlight messages to the Router; up
// to slotQueue more wait in the slots' queue, so a slot that got its
// verdict takes the next message without waiting for the owner.
func (sub *subscription) maxHandedOut() int {
	if sub.outlet.slots != nil {
		return sub.outlet.slots.capacity()
	}
	return sub.cfg.MaxInFlight
}

// dispatch hands messages to the slots while there is room (MaxInFlight >
// 1). A slot sends the message to the Router and waits for its verdict, so
// the owner wakes only to take verdicts, in batches while busy.
func (sub *subscription) dispatch(now time.Time) {
	if sub.outlet.slots == nil {
		return
	}
	for sub.hand.handed < sub.outlet.slots.capacity() && !sub.drain.stopping && !sub.backpressured() && len(sub.hand.buffer) > 0 {
		d := sub.hand.buffer[0]
		if sub.isolating() || sub.runsAlone(d) && d.state != finished && !sub.settledForAlone(now) {
			return // a redelivered row runs alone: after the others answered, and nothing beside it
		}
		if sub.hand.alone.behind && (sub.writes.inWrite || !sub.writes.pending.empty()) {
			// A row that runs alone went back (awaitingAlone): not before
			// that is written, its delivery taken back, or a crash of the
			// rows ahead of it would count it.
			return
		}
		sub.hand.buffer[0] = nil
		sub.hand.buffer = sub.hand.buffer[1:]
		if d.state != finished && sub.admit(d, now) {
			sub.handedOut(d) // the slot builds the message
			if sub.runsAlone(d) {
				sub.hand.alone.row = d
			}
		}
	}
}

// endMessage cancels the context of d's message where the owner built it
// (a slot cancels the ones it built itself).
func (sub *subscription) endMessage(d *delivery) {
	if d.cancel != nil {
		d.cancel()
	}
	d.msg, d.cancel = nil, nil
}

// endRow is the one way a row leaves the subscription's hands: written,
// ended with its held batch, completed by a handler's transaction, or
// held by someone else now. Whatever still points at it (the prepared
// message, a hand-out, ordered mode's retry) lets go, and the next row of
// its key may be claimed.
func (sub *subscription) endRow(d *delivery) {
	if sub.hand.ready == d {
		sub.endMessage(d)
		sub.hand.ready = nil
	}
	running := false // its handler may still run: let go of it when it answers
	if d.state == handedOut {
		switch {
		case sub.drain.over:
			sub.stopWatching(d)
			sub.endMessage(d)
		case sub.hand.single == d:
			// Ordered: its handler is told to stop (its context ends), and
			// nothing is handed out until it returns: one message at a
			// time, even one whose row is no longer ours. The owner still
			// waits for its Ack or Nack, so the message stays.
			d.cancel()
			running = true
		default:
			// Its handler is told to stop, and its slot waits for the
			// answer (or the ack deadline): the row, claimed again, does
			// not go out beside it (rowGuard), and MaxInFlight counts it.
			d.outcome.cancelMessage()
			sub.hand.guard.lost[d] = struct{}{}
			running = true
		}
		sub.hand.handed--
	}
	if sub.hand.retry == d {
		sub.hand.retry = nil
	}
	delete(sub.hand.rows, d)
	d.state, d.batch = finished, nil
	// The claim's slab array may outlive this row (deliverySlab): it must
	// not keep the message's bytes.
	d.payload, d.metaRaw = nil, nil
	sub.keyEnded(d)
	if !running {
		sub.letGo(d)
	}
}

// letGo forgets d, which runs in no handler now, and puts the rows that
// were claimed again while it was ours (rowGuard) into the buffer at
// their place in queue order: several may be let go in one turn (the rows
// of a failed held batch), each in its own call.
func (sub *subscription) letGo(d *delivery) {
	free := sub.hand.guard.letGo(d)
	if len(free) == 0 {
		return
	}
	if sub.drain.stopping {
		sub.giveBack(free)
		return
	}
	if r := sub.hand.ready; r != nil { // prepared already: it may come after them
		sub.hand.ready = nil
		sub.hand.buffer = append([]*delivery{r}, sub.hand.buffer...)
	}
	for _, w := range free {
		i := slices.IndexFunc(sub.hand.buffer, func(b *delivery) bool { return queuedBefore(w, b) })
		if i < 0 {
			i = len(sub.hand.buffer)
		}
		sub.hand.buffer = slices.Insert(sub.hand.buffer, i, w)
	}
}

// queuedBefore reports whether a comes before b in a claim's order.
func queuedBefore(a, b *delivery) bool {
	if !a.availableAt.Equal(b.availableAt) {
		return a.availableAt.Before(b.availableAt)
	}
	return a.id < b.id
}

// answeredLate takes in the answer of a delivery that had ended while its
// handler ran (endRow): the rows waiting for it may go out.
func (sub *subscription) answeredLate(d *delivery) {
	if sub.hand.single == d {
		sub.hand.single = nil
	} else if _, ok := sub.hand.guard.lost[d]; ok {
		delete(sub.hand.guard.lost, d)
	} else {
		return
	}
	if d.state == finished {
		sub.letGo(d)
	}
}

// abandonLost stops waiting for the handlers of lost rows (the drain is
// over, or the subscription ends).
func (sub *subscription) abandonLost() {
	for d := range sub.hand.guard.lost {
		delete(sub.hand.guard.lost, d)
		close(d.stopWatch)
		sub.letGo(d)
	}
}

// handing is a delivery's hand-out to the Router: the message, its
// context's cancel, what the handler's side reports through, and the
// watcher's stop (see handout.go).
type handing struct {
	handedAt  instant          // when the message went to the Router
	msg       *message.Message // the message handed out (nil before)
	cancel    context.CancelFunc
	outcome   *outcome
	stopWatch chan struct{} // closed by the owner when it stops waiting for a verdict
}

// orderedRetry is an ordered subscription's own redelivery of a nacked
// row: it keeps the lease and delivers the row again at retryAt, once the
// hold is written and then, at retryAt, the retry's delivery counted.
type orderedRetry struct {
	retryAt  instant
	holdDone bool // the last hold written (the nack's, then the count's)
	counted  bool // the count's hold asked: the retry's delivery is (being) counted
}
