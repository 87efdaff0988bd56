package pgoutbox

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/handoff"
	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
	"github.com/pgoutbox/watermill-pgoutbox/internal/testhook"
)

// subscription is one Subscribe call. One goroutine, the owner (run),
// holds all of its state, in parts that each keep their own fields:
//
//   - claims (claims.go): when to claim, how many rows, from where;
//   - hand (handout.go): the rows we hold, the buffer, what is handed out;
//   - writes (writes.go): verdicts waiting for the completer, its pacing;
//   - house (housekeeping.go): ack deadlines, stalled buffers, renewals;
//   - drain (shutdown.go): stopping and the drain;
//   - held (held.go): the held path's open batches and when to hold.
//
// Code that runs beside the owner keeps no state of the subscription: it
// gets a request and returns a result over reports (the claimer runs claim
// statements, the completer writes batches, batch ends commit held
// transactions) or the inbox (the slots' verdicts, handlers' unhold
// requests). Nothing is shared under a lock, so there is no lock order to
// get wrong, and one row is in exactly one state (deliveryState) at a time.
type subscription struct {
	s      *Subscriber
	cfg    *SubscriberConfig
	topic  string
	logger watermill.LoggerAdapter

	// Plumbing to the goroutines beside the owner.
	out        chan *message.Message
	signals    signals     // wake-ups and stop signals, forwarded as reports
	reports    chan report // results of the claimer, the completer and batch ends
	inbox      *verdictInbox
	verdictBuf []verdict
	slots      *slots          // MaxInFlight > 1; nil: the owner hands out itself
	msgParent  context.Context // the parent of message contexts (messageParent)
	comp       *completer
	claimer    *claimer
	timer      ownerTimer

	// The owner's state, in parts.
	claims claimSchedule
	hand   handout
	writes writeQueue
	house  housekeeping
	drain  drain
	held   heldPath
}

// report is what the claimer, the completer, a batch end or the signals
// send the owner: one channel for all keeps the owner's select small.
type report struct {
	claim *claimResult
	write *writeResult
	batch *batchResult
	stop  bool // the Subscribe context ended or the Subscriber closes
	// none of them: the notifier woke the subscription (waiter.Take says why)
}

// verdict is a handler's answer for a delivery, sent by its slot.
type verdict struct {
	d        *delivery
	seq      uint32           // the hand-out it answers: a late answer of an earlier one is ignored
	msg      *message.Message // the message handed out (its metadata after the handler)
	poison   error            // the row did not decode (a slot found out)
	ack      bool
	unsent   bool // the subscription stopped before the Router took the message
	timedOut bool // no Ack or Nack within AckDeadline
}

func newSubscription(s *Subscriber, ctx context.Context, topic string, waiter *notifier.Waiter) *subscription {
	now := time.Now()
	sub := &subscription{
		s:         s,
		cfg:       &s.cfg,
		topic:     topic,
		logger:    s.logger.With(watermill.LogFields{"topic": topic}),
		out:       make(chan *message.Message),
		signals:   newSignals(ctx, s.closing, waiter),
		msgParent: messageParent(ctx),
		inbox:     newVerdictInbox(),
		reports:   make(chan report, 3+maxHeldBatches), // one claim, one write, one signal and the held batches' ends
		timer:     newOwnerTimer(),
		claims:    newClaimSchedule(&s.cfg, now),
		hand:      handout{rows: map[*delivery]struct{}{}},
		writes:    writeQueue{gate: newRetryGate()},
		house:     housekeeping{nextRenew: now.Add(s.cfg.Lease / 2)},
		held:      heldPath{forced: testhook.ClaimPath(s.cfg.WorkerID)},
	}
	if s.cfg.MaxInFlight > 1 {
		// The whole lease window fits: slots take the next message
		// without waiting for the owner, as the claim fills the queue.
		sub.slots = newSlots(s.cfg.MaxInFlight+maxPrefetch, sub.inbox,
			slotEnv{out: sub.out, parent: sub.msgParent, ackDeadline: s.cfg.AckDeadline})
	}
	sub.comp = newCompleter(s.pool, s.q, &s.cfg, topic, sub.reports)
	sub.claimer = &claimer{pool: s.pool, q: s.q, cfg: &s.cfg, topic: topic, stop: sub.signals.stopCtx}
	return sub
}

// ordered reports whether the subscription keeps publish order: one message
// at a time, a nacked one delivered again before any later one.
func (sub *subscription) ordered() bool { return sub.cfg.MaxInFlight == 1 }

// run is the owner goroutine. It returns after the output channel is closed.
//
// Its select has few cases on purpose: in a drain the owner parks there for
// nearly every message, and a select costs in proportion to its channels.
// So every timed event (idle wake, retry, backoffs, housekeeping, end of the
// drain) shares one timer, and the stop signals one channel.
func (sub *subscription) run() {
	defer sub.s.subs.Done()
	go sub.comp.run()
	defer sub.comp.stop()

	// The signals from outside (a wake-up from the notifier, the end of
	// the Subscribe context, the Subscriber's Close) reach the owner as
	// reports, so its select waits on few channels.
	sub.signals.start(sub.reports)
	if sub.slots != nil {
		sub.slots.start(sub.cfg.MaxInFlight)
	}
	sub.house.next = time.Now().Add(housekeepingEvery(sub.cfg))
	fast := 0

	for {
		now := time.Now()
		sub.passedTimes(now)
		sub.startClaim(now)
		sub.startWrite(now)
		if sub.drain.stopping && sub.finishedStopping(now) {
			break
		}
		var head *delivery
		var sendC chan *message.Message
		if sub.slots != nil {
			sub.dispatch(now)
		} else {
			head, sendC = sub.nextMessage(now)
		}
		var msg *message.Message // select evaluates every send's value, also on a nil channel
		if head != nil {
			msg = head.msg
		}
		var ackC, nackC <-chan struct{}
		var single *message.Message
		if sub.hand.single != nil {
			single = sub.hand.single.msg
			ackC, nackC = single.Acked(), single.Nacked()
		}
		// Fast path while busy: hand out and take verdicts without the
		// full select, a bounded number of turns so timers and stops are
		// never starved.
		if fast < maxFastTurns {
			fast++
			select {
			case sendC <- msg:
				sub.handedOut(head)
				continue
			case <-sub.inbox.wake:
				sub.takeVerdicts()
				continue
			case <-ackC:
				sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single, ack: true}, false)
				continue
			case <-nackC:
				sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single}, false)
				continue
			default:
			}
		}
		fast = 0
		sub.armTimer(now)

		select {
		case sendC <- msg:
			sub.handedOut(head)
		case <-sub.inbox.wake:
			sub.takeVerdicts()
		case <-ackC:
			sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single, ack: true}, false)
		case <-nackC:
			sub.onVerdict(verdict{d: sub.hand.single, seq: sub.hand.single.seq, msg: single}, false)
		case r := <-sub.reports:
			switch {
			case r.claim != nil:
				sub.onClaimed(*r.claim)
			case r.write != nil:
				sub.onWritten(*r.write)
			case r.batch != nil:
				sub.finishedBatch(*r.batch)
			case r.stop:
				if !sub.drain.stopping {
					sub.beginStop()
				}
			default:
				sub.onNotified(sub.signals.waiter.Take())
			}
		case <-sub.timer.t.C:
			sub.timer.fired() // passedTimes acts on it
		}
	}
	if sub.slots != nil {
		sub.slots.end() // none sends on out any more
	}
	sub.signals.end()
	close(sub.out)
	sub.logger.Debug("Subscription closed", nil)
}

// onNotified handles what the notifier reported: rows due, rows scheduled
// (an empty claim plans the sleep anew, NextDue), rows another subscriber
// of this group returned, or a vanished liveness lock (look for orphaned
// rows).
func (sub *subscription) onNotified(k notifier.Kinds) {
	if k.Orphans {
		sub.claims.scan.findOrphans = true
	}
	if k.Vanished {
		// A process may have died: the rows of its held transactions are
		// due again, behind a busy loop's cursor.
		sub.claims.scan.restart(false)
	}
	if k.Due {
		// Publishers notify once per cooldown (PublisherConfig.
		// NotifyCooldown): rows of the quiet publishes right after this
		// one are found by a look again shortly after.
		sub.claims.lookAgain = lookAgainFirst
	}
	sub.wake(false)
}

// After a wake-up by a publisher, an idle subscription looks again
// lookAgainFirst later, then at doubling intervals up to lookAgainLast
// (or its idle poll interval, when that is shorter): a row published
// quietly right after the notifying one waits about a cooldown, and one
// whose transaction commits later is found within about the time it took
// to commit, not a poll interval. Each look is one claim that finds
// nothing, and it stops at the first idle poll.
const (
	lookAgainFirst = 2 * DefaultNotifyCooldown
	lookAgainLast  = 512 * time.Millisecond
)

// maxFastTurns bounds the owner's turns on the fast path (see run).
const maxFastTurns = 64

// housekeepingEvery is the period of the owner's checks of renewals, ack
// deadlines and stalled buffers.
func housekeepingEvery(cfg *SubscriberConfig) time.Duration {
	d := min(time.Second, cfg.Lease/10)
	if cfg.AckDeadline > 0 {
		d = min(d, cfg.AckDeadline/10)
	}
	return max(d, 10*time.Millisecond)
}

// wake makes the next claim happen as soon as there is room. An idle loop
// scans from the start then: whatever woke it (a commit of a transaction
// that began before rows it claimed, a released lease) may lie behind the
// cursor; a busy loop scans from the start every second anyway.
func (sub *subscription) wake(expired bool) {
	if sub.claims.claiming {
		sub.claims.wokeDuring = true
	}
	if !sub.claims.want && !sub.claims.scan.resume {
		sub.claims.scan.restart(expired)
	}
	sub.claims.scan.resume = false
	sub.claims.want = true
	sub.claims.idleUntil = time.Time{}
}

// armTimer points the owner's one timer at the next timed event still to
// come. Events already due were handled by passedTimes: arming a timer for
// them would make the loop spin.
func (sub *subscription) armTimer(now time.Time) {
	var at time.Time
	earliest := func(t time.Time) {
		if t.After(now) && (at.IsZero() || t.Before(at)) {
			at = t
		}
	}
	earliest(sub.claims.idleUntil)
	earliest(sub.house.next)
	earliest(sub.drain.end)
	earliest(sub.writes.gate.until)
	earliest(sub.writes.ackWait)
	earliest(sub.claims.gate.until)
	for _, b := range sub.held.batches {
		if !b.closing {
			earliest(b.deadline)
		}
	}
	if len(sub.held.batches) >= maxHeldBatches {
		earliest(sub.held.batches[0].claimedAt.Add(heldPatience)) // see batchesBusy
	}
	if sub.hand.retry != nil && sub.hand.retry.holdDone {
		earliest(sub.hand.retry.retryAt.time())
	}
	sub.timer.point(at, now)
}

// passedTimes acts on the timed events that are due: the end of an idle
// sleep, of a backoff, of the drain, and housekeeping.
func (sub *subscription) passedTimes(now time.Time) {
	if !sub.claims.idleUntil.IsZero() && !now.Before(sub.claims.idleUntil) {
		sub.wake(true) // the sleep may have been set to a lease expiry
	}
	sub.claims.gate.pass(now)
	sub.writes.gate.pass(now)
	if !now.Before(sub.house.next) {
		sub.housekeeping(now)
		sub.house.next = now.Add(housekeepingEvery(sub.cfg))
	}
	if !sub.drain.end.IsZero() && !now.Before(sub.drain.end) {
		sub.drain.end = time.Time{}
		sub.endDrain()
	}
	if len(sub.held.batches) > 0 {
		sub.tendBatches(now)
	}
}

// unjudged is the number of leased rows without a verdict: the lease window.
func (sub *subscription) unjudged() int {
	n := len(sub.hand.buffer) + sub.hand.handed
	if sub.hand.ready != nil {
		n++
	}
	return n
}

// takeBuffer empties the buffer, the prepared message first, in order.
func (sub *subscription) takeBuffer() []*delivery {
	buf := sub.hand.buffer
	if sub.hand.ready != nil {
		buf = append([]*delivery{sub.hand.ready}, buf...)
	}
	sub.hand.buffer, sub.hand.ready = nil, nil
	return buf
}

// backpressured reports whether verdicts wait to be written in such numbers
// that the subscription should neither claim nor hand out more: a
// completion path that cannot write would otherwise let it lease ever more
// rows, and a crash would redeliver them all.
func (sub *subscription) backpressured() bool {
	return sub.writes.pending.ops()+sub.comp.writing() >= maxPendingCompletions
}

// maxPendingCompletions bounds the verdicts not yet written per
// subscription, so a crashed process leaves at most MaxInFlight +
// maxPendingCompletions handled but unacked messages behind.
const maxPendingCompletions = 256

// startClaim starts a claim when one is wanted and there is room.
func (sub *subscription) startClaim(now time.Time) {
	switch {
	case sub.claims.claiming, sub.drain.stopping, !sub.claims.want, sub.claims.givingBack > 0, sub.hand.retry != nil,
		sub.claims.gate.shut(), sub.backpressured():
		return
	}
	if sub.batchesBusy(now) {
		return // a batch ends soon: claim on the held path then
	}
	floor := 0
	if now.Before(sub.claims.scan.keyedUntil) { // keyed rows seen, not just a slow claim
		floor = maxClaim // hold many keys: see claimSizeAtLeast
	}
	n := sub.claims.pf.claimSizeAtLeast(sub.unjudged(), now, floor)
	if n == 0 {
		return
	}
	sub.claims.claiming = true
	req := sub.claims.scan.request(n, sub.claims.gen, now)
	req.holder = sub.holder()
	if len(sub.claims.endedKeys) > 0 {
		req.window = max(2*n, minScanWindow) // "heads" is in the windowed claim only
		for k := range sub.claims.endedKeys {
			req.endedKeys = append(req.endedKeys, k)
		}
		clear(sub.claims.endedKeys)
	}
	if sub.claims.scan.findOrphans {
		// Not before the notifier made two checks: until then it cannot
		// tell a dead holder from a reconnecting one.
		if spare, ok := sub.signals.waiter.Spare(); ok {
			req.orphansOf = spare
		}
	}
	req.held = sub.wantHeld(req, now)
	go func() {
		r := sub.claimer.run(req)
		sub.reports <- report{claim: &r}
	}()
}

// holder is what this process's rows are stamped with: its liveness key
// while it holds the lock, else NULL (liveness unknown: lease expiry only).
func (sub *subscription) holder() pgtype.Int8 {
	key, live := sub.signals.waiter.Liveness()
	return pgtype.Int8{Int64: key, Valid: live && key != 0}
}

// onClaimed takes a claim's rows into the buffer.
func (sub *subscription) onClaimed(r claimResult) {
	sub.claims.claiming = false
	woke := sub.claims.wokeDuring
	sub.claims.wokeDuring = false
	now := time.Now()
	if r.err != nil && r.req.held {
		// The transaction rolled back (or its connection is closed, which
		// the server rolls back): nothing to give back.
		for _, k := range r.req.endedKeys {
			sub.claims.endedKeys[k] = struct{}{}
		}
		wait := sub.claims.gate.failed(now)
		sub.logger.Error("Claim failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String(), "path": PathHeld})
		return
	}
	if r.err != nil {
		// The statement may have committed: its rows would stay leased
		// under a token nobody holds. Give them back (ReleaseClaim) instead
		// of letting them wait for the lease, and without counting a
		// delivery nobody saw. Like any give-back, claims wait for it and
		// then scan from the start, so the rows keep their place.
		sub.claims.lost = append(sub.claims.lost, claimToken{token: r.req.token, at: r.req.sent})
		for _, k := range r.req.endedKeys { // that claim did not happen
			sub.claims.endedKeys[k] = struct{}{}
		}
		sub.claims.givingBack++
		sub.claims.gen++
		if r.req.orphansOf != nil {
			sub.claims.scan.findOrphans = true // that look did not happen
		}
		wait := sub.claims.gate.failed(now)
		sub.logger.Error("Claim failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String()})
		return
	}
	sub.claims.gate.succeeded()
	sub.held.busy = len(r.rows) > 0
	sub.claims.scan.claimed(r)
	if len(r.req.endedKeys) > 0 && (len(r.rows) >= r.req.n || r.reclaimed > 0) {
		// The claim was full: the next rows of some ended keys may not have
		// fit. Ask again for the keys that got none.
		got := map[string]bool{}
		for _, d := range r.rows {
			got[d.orderingKey] = true
		}
		for _, k := range r.req.endedKeys {
			if !got[k] {
				sub.claims.endedKeys[k] = struct{}{}
			}
		}
	}
	path := PathLease
	if r.req.held {
		path = PathHeld
	}
	sub.s.obs.observe(Event{Kind: EventClaimed, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, Count: len(r.rows), Path: path})
	for _, d := range r.rows {
		d.claimedAt = at(r.req.sent)
		d.expiresAt = d.claimedAt.add(sub.cfg.Lease)
		d.batch = r.batch
		sub.hand.rows[d] = struct{}{}
	}
	if b := r.batch; b != nil {
		b.claimedAt, b.deadline = r.req.sent, sub.bound(r.req.sent)
		sub.held.batches = append(sub.held.batches, b)
	}
	if sub.drain.stopping || r.req.gen != sub.claims.gen {
		// Stopping, or rows went back while this claim ran: these rows may
		// be newer than those, so they go back too, and the next claim
		// takes everything from the start, in order.
		sub.giveBack(r.rows)
		return
	}
	sub.hand.buffer = append(sub.hand.buffer, r.rows...)
	if len(r.rows) > 0 {
		sub.claims.want, sub.claims.idlePoll = true, sub.cfg.MinPollInterval
		if sub.claims.lookAgain > 0 {
			// Still busy after a publisher's wake-up: quiet publishes may
			// keep coming, keep looking again after the claims run dry.
			sub.claims.lookAgain = lookAgainFirst
		}
		return
	}
	if r.keyBusy > 0 {
		// Keyed rows whose key another claim took meanwhile: look again
		// after the shortest idle wait, from the start, not at claim speed.
		sub.claims.scan.restart(false)
		sub.claims.want = false
		sub.claims.idleUntil = now.Add(sub.cfg.MinPollInterval)
		return
	}
	if woke {
		// The wake-up may announce a row committed after this claim's
		// snapshot: claim again instead of sleeping.
		sub.claims.scan.restart(false)
		sub.claims.want = true
		return
	}
	if r.cursor.Valid && r.free > 0 {
		// Competitors' claims had locked the rows of the window: the
		// cursor moved past them, go on at once.
		sub.claims.want = true
		return
	}
	if r.cursor.Valid {
		// Every row of the window waits for its key (held here or by a
		// competitor): go on from the cursor after the shortest idle wait,
		// so a backlog of held keys is read one window per wait, not at
		// claim speed. An ended key's next row is asked for directly.
		sub.claims.scan.resume = true
		sub.claims.want = false
		sub.claims.idleUntil = now.Add(sub.cfg.MinPollInterval)
		return
	}
	sub.claims.want = false
	var wait time.Duration
	if sub.claims.lookAgain > 0 && sub.claims.lookAgain < sub.claims.idlePoll && sub.claims.lookAgain <= lookAgainLast {
		wait = sub.claims.lookAgain
		sub.claims.lookAgain *= 2
	} else {
		sub.claims.lookAgain = 0
		wait = jitter(sub.claims.idlePoll)
		sub.claims.idlePoll = min(sub.claims.idlePoll*2, sub.cfg.MaxPollInterval)
	}
	if r.dueIn > 0 && r.dueIn < wait {
		wait = r.dueIn
	}
	sub.claims.idleUntil = now.Add(wait)
}

// nextMessage returns the delivery to hand out next, with the output
// channel to send it on, or a nil channel when nothing may go out now. Rows
// that must not go out (lease likely gone, too many deliveries,
// undecodable) are dealt with on the way.
func (sub *subscription) nextMessage(now time.Time) (*delivery, chan *message.Message) {
	if sub.drain.stopping || sub.backpressured() {
		return nil, nil
	}
	full := sub.hand.handed >= sub.maxHandedOut()
	if d := sub.hand.retry; d != nil {
		if !d.holdDone || at(now) < d.retryAt || full {
			return nil, nil // ordered: nothing overtakes the retry
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
	return sub.hand.ready, sub.out
}

// prepare admits d and builds its message (MaxInFlight 1: the owner hands
// it out itself), or sends d where it belongs instead and returns false.
func (sub *subscription) prepare(d *delivery, now time.Time) bool {
	if !sub.admit(d, now) {
		return false
	}
	d.outcome = newOutcome(d, sub.s.q.CompleteInTx, sub.unholder(d))
	msg, cancel, err := buildMessage(sub.msgParent, d.uuid, d.payload, d.metaRaw, d.orderingKey, d.outcome)
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
			back = append(back, sub.takeBuffer()...)
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
	if sub.slots == nil {
		sub.hand.single = d
		return
	}
	d.outcome, d.stopWatch = newOutcome(d, sub.s.q.CompleteInTx, sub.unholder(d)), make(chan struct{})
	// Never blocks: see maxHandedOut.
	sub.slots.hand(slotItem{d: d, seq: d.seq, uuid: d.uuid, payload: d.payload, metaRaw: d.metaRaw, orderingKey: d.orderingKey,
		outcome: d.outcome, abandon: d.stopWatch})
}

// takeQueued takes back the deliveries in the slots' queue that no slot
// took yet, in queue order; they count as handed out no more.
func (sub *subscription) takeQueued() []*delivery {
	if sub.slots == nil {
		return nil
	}
	var out []*delivery
	for _, it := range sub.slots.takeQueued() {
		it.d.state = buffered
		sub.hand.handed--
		out = append(out, it.d)
	}
	return out
}

// oldestHandedOut is how long ago the oldest delivery still handed out
// went to the slots.
func (sub *subscription) oldestHandedOut(now time.Time) time.Duration {
	var oldest time.Duration
	for d := range sub.hand.rows {
		if d.state == handedOut {
			oldest = max(oldest, at(now).since(d.handedAt))
		}
	}
	return oldest
}

// maxHandedOut bounds the deliveries given to the Router or to the slots.
// MaxInFlight slots send at most MaxInFlight messages to the Router; the
// rest of the lease window waits in the slots' queue, so a slot that got
// its verdict takes the next message without waiting for the owner.
func (sub *subscription) maxHandedOut() int {
	if sub.slots != nil {
		return sub.slots.capacity()
	}
	return sub.cfg.MaxInFlight
}

// dispatch hands messages to the slots while there is room (MaxInFlight >
// 1). A slot sends the message to the Router and waits for its verdict, so
// the owner wakes only to take verdicts, in batches while busy.
func (sub *subscription) dispatch(now time.Time) {
	if sub.slots == nil {
		return
	}
	for sub.hand.handed < sub.slots.capacity() && !sub.drain.stopping && !sub.backpressured() && len(sub.hand.buffer) > 0 {
		d := sub.hand.buffer[0]
		sub.hand.buffer[0] = nil
		sub.hand.buffer = sub.hand.buffer[1:]
		if d.state != finished && sub.admit(d, now) {
			sub.handedOut(d) // the slot builds the message
		}
	}
}

// takeVerdicts applies the verdicts the slots reported.
func (sub *subscription) takeVerdicts() {
	var unholds []unholdRequest
	sub.verdictBuf, unholds = sub.inbox.take(sub.verdictBuf)
	for _, r := range unholds {
		sub.unhold(r)
	}
	for _, v := range sub.verdictBuf {
		if v.timedOut {
			if v.d.state == handedOut && v.d.seq == v.seq {
				sub.ackDeadlinePassed(v.d, v.msg)
			}
			continue
		}
		sub.onVerdict(v, false)
	}
	clear(sub.verdictBuf)
}

// stopWatching ends the wait for d's verdict: a later answer is ignored.
func (sub *subscription) stopWatching(d *delivery) {
	if sub.hand.single == d {
		sub.hand.single = nil
		return
	}
	close(d.stopWatch)
}

// onVerdict records a handler's answer. timedOut marks a nack the owner
// made itself when the ack deadline passed.
func (sub *subscription) onVerdict(v verdict, timedOut bool) {
	d := v.d
	if d.state != handedOut || d.seq != v.seq {
		return // a late answer: the deadline or the drain ended this delivery
	}
	if sub.hand.single == d {
		sub.hand.single = nil
	}
	sub.hand.handed--
	if v.unsent {
		// The Router never took it: it goes back as if never handed out.
		sub.giveBack([]*delivery{d})
		return
	}
	sub.claims.pf.verdicts(1)
	sub.endMessage(d) // Ack and Nack end the message's context
	if v.poison != nil {
		sub.poisoned(d, v.poison)
		return
	}
	if d.outcome.completedInTx() {
		// The handler's transaction deleted the row and committed (with
		// the handler's writes): acked, and nothing is left to write. A
		// Nack after that commit (a middleware outside failed) cannot
		// bring the row back.
		delete(sub.hand.rows, d)
		d.state = finished
		sub.keyEnded(d)
		sub.s.obs.observe(Event{Kind: EventAcked, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathLease})
		return
	}
	if v.ack {
		d.state = writing
		if d.batch != nil {
			sub.heldAck(d)
			return
		}
		sub.writes.pending.acks = append(sub.writes.pending.acks, d)
		return
	}
	n := sub.decideNack(d, v.msg, timedOut)
	switch {
	case n.deadReason != "":
		sub.deadLetter(d, n.deadReason, n.errText)
	case sub.ordered() && !sub.drain.stopping:
		// Ordered: the row stays ours and goes out again before anything
		// later, after its delay. The buffer goes back meanwhile, in order,
		// rather than sit leased through a long delay.
		d.state, d.retryAt, d.holdDone = retrying, at(time.Now()).add(n.delay), false
		if n.meta != nil {
			d.metaRaw = n.meta // as the hold stores it
		}
		sub.hand.retry = d
		job := sub.jobFor(d)
		job.holds = append(job.holds, holdOp{d: d, err: textOrNull(n.errText), meta: metaOrNull(n.meta)})
		if n.delay > 0 {
			sub.giveBack(sub.takeBuffer())
			sub.claims.gen++ // a claim under way gives its rows back too
		}
	default:
		d.state = writing
		job := sub.jobFor(d)
		job.returns = append(job.returns, returnOp{d: d, delay: delayOf(n.delay),
			err: textOrNull(n.errText), meta: metaOrNull(n.meta)})
	}
}

// deadLetter ends d terminally: moved to the dead-letter table, or parked.
func (sub *subscription) deadLetter(d *delivery, reason, errText string) {
	d.state = writing
	job := sub.jobFor(d)
	job.dead = append(job.dead, deadOp{d: d, reason: reason, err: textOrNull(boundError(errText))})
}

// giveBack returns rows that no handler saw, keeping their place in line
// and taking their delivery back. Claims wait until the give-back is
// written, and then scan from the start, so the rows come back in order.
func (sub *subscription) giveBack(ds []*delivery) {
	if len(ds) == 0 {
		return
	}
	sub.claims.gen++
	sub.claims.scan.restart(false)
	sub.claims.want = true
	for _, d := range ds {
		if d.state == finished {
			continue
		}
		sub.endMessage(d)
		d.state = writing
		sub.claims.givingBack++
		if b := d.batch; b != nil {
			if b.closing { // becoming a lease: give that back after the commit
				b.deferred.returns = append(b.deferred.returns, returnOp{d: d, undo: 1, giveBack: true})
				continue
			}
			sub.decideHeld(d, heldReleased) // the commit drops its lock
			continue
		}
		sub.writes.pending.returns = append(sub.writes.pending.returns, returnOp{d: d, undo: 1, giveBack: true})
	}
}

// release returns a handed-out row whose verdict will not come (the drain is
// over): due again at once, its delivery counted.
func (sub *subscription) release(d *delivery) {
	d.state = writing
	job := sub.jobFor(d)
	job.returns = append(job.returns, returnOp{d: d})
}

// housekeeping runs the periodic checks: ack deadlines, stalled buffers,
// lease renewals.
func (sub *subscription) housekeeping(now time.Time) {
	if sub.cfg.AckDeadline > 0 && sub.slots == nil { // with slots, each slot keeps it
		for d := range sub.hand.rows {
			if d.state == handedOut && at(now).since(d.handedAt) >= sub.cfg.AckDeadline && !d.outcome.completingInTx() {
				sub.ackDeadlinePassed(d, d.msg)
			}
		}
	}
	// A prefetched row still waiting half a lease after its claim means the
	// handlers are stuck or slow: give the whole buffer back (all of it, so
	// the rows keep their order) for other consumers, rather than hold it.
	oldest := sub.hand.ready
	if oldest == nil && len(sub.hand.buffer) > 0 {
		oldest = sub.hand.buffer[0]
	}
	if oldest != nil && at(now).since(oldest.claimedAt) > sub.cfg.Lease/2 {
		sub.giveBack(sub.takeBuffer())
	}
	if sub.slots != nil && sub.slots.queued() > 0 && sub.oldestHandedOut(now) > sub.cfg.Lease/2 {
		// The same for the slots' queue: what no slot took yet goes back.
		sub.giveBack(sub.takeQueued())
	}
	if !now.Before(sub.house.nextRenew) && sub.writes.pending.renew == nil {
		var rows []*delivery
		for d := range sub.hand.rows {
			// Rows with a write pending are left out: the write ends the
			// lease (or keeps it, a hold), and a renewal after it in the
			// same batch would find the row gone and call it lost.
			// Held rows have no lease to renew.
			if d.state != writing && !(d.state == retrying && !d.holdDone) && d.batch == nil {
				rows = append(rows, d)
			}
		}
		if len(rows) > 0 {
			sub.writes.pending.renew, sub.writes.pending.renewHolder = rows, sub.holder()
		}
		sub.house.nextRenew = now.Add(sub.cfg.Lease / 2)
	}
}

// ackDeadlinePassed ends a delivery whose handler did not answer within
// AckDeadline: its context is cancelled, its lease no longer renewed, and
// the row nacked with a recorded error (a delivery, counted as such).
func (sub *subscription) ackDeadlinePassed(d *delivery, msg *message.Message) {
	sub.stopWatching(d)
	sub.logger.Error("Handler did not ack or nack within AckDeadline; the message is nacked and its context cancelled", nil,
		watermill.LogFields{"event": "ack_deadline", "row_id": d.id, "deliveries": d.deliveries, "ack_deadline": sub.cfg.AckDeadline.String()})
	d.outcome.setErr(fmt.Errorf("%w: no ack or nack within %s", ErrAckDeadline, sub.cfg.AckDeadline))
	sub.onVerdict(verdict{d: d, seq: d.seq, msg: msg}, true)
}

// endMessage cancels the context of d's message where the owner built it
// (a slot cancels the ones it built itself).
func (sub *subscription) endMessage(d *delivery) {
	if d.cancel != nil {
		d.cancel()
	}
	d.msg, d.cancel = nil, nil
}

// beginStop stops claiming and handing out, gives the buffer back, and
// starts the drain.
func (sub *subscription) beginStop() {
	sub.drain.stopping = true
	sub.signals.cancelStop()
	queued := sub.takeQueued()
	if sub.slots != nil {
		sub.slots.stopOffering() // a slot holding a message reports it unsent
	}
	sub.giveBack(append(queued, sub.takeBuffer()...))
	if d := sub.hand.retry; d != nil && d.holdDone {
		// Not delivered again yet: the hold counted that delivery.
		sub.hand.retry = nil
		sub.giveBack([]*delivery{d})
	}
	if sub.cfg.DrainTimeout < 0 {
		sub.endDrain()
		return
	}
	sub.drain.end = time.Now().Add(sub.cfg.DrainTimeout)
}

// endDrain stops waiting for handlers: the rows still handed out go back
// (under their tokens), never deleted; a late Ack is ignored.
func (sub *subscription) endDrain() {
	sub.drain.over = true
	for d := range sub.hand.rows {
		if d.state == handedOut {
			sub.stopWatching(d)
			sub.endMessage(d)
			sub.hand.handed--
			sub.release(d)
		}
	}
}

// finishedStopping reports whether a stopping subscription may end: no
// handler to wait for, no claim under way, everything written, or the final
// writes given up on after their deadline.
func (sub *subscription) finishedStopping(now time.Time) bool {
	if sub.hand.handed > 0 || sub.claims.claiming || len(sub.held.batches) > 0 {
		return false
	}
	if sub.writes.finalDeadline.IsZero() {
		sub.writes.finalDeadline = now.Add(sub.cfg.StatementTimeout)
		sub.comp.setDeadline(sub.writes.finalDeadline)
	}
	if sub.writes.inWrite {
		return false
	}
	if sub.writes.pending.empty() && len(sub.claims.lost) == 0 && sub.hand.retry == nil {
		return true
	}
	if sub.writes.finalFailures >= 3 || now.After(sub.writes.finalDeadline) {
		sub.logger.Error("Giving up writing acks and lease returns at close; those rows are redelivered when their leases expire", nil,
			watermill.LogFields{"pending": sub.writes.pending.ops()})
		return true
	}
	return false
}

// startWrite hands the pending verdicts to the completer when it is free.
func (sub *subscription) startWrite(now time.Time) {
	if sub.writes.inWrite || sub.writes.gate.shut() {
		return
	}
	if sub.onlyFewAcks() && now.Sub(sub.writes.last) < ackPacing {
		sub.writes.ackWait = sub.writes.last.Add(ackPacing) // armTimer wakes us then
		return
	}
	sub.writes.ackWait, sub.writes.last = time.Time{}, now
	job := sub.writes.pending
	for _, c := range sub.claims.lost {
		job.releaseTokens = append(job.releaseTokens, c.token)
	}
	if job.empty() && len(job.releaseTokens) == 0 {
		return
	}
	sub.writes.pending = writeJob{}
	sub.writes.inWrite = true
	sub.comp.submit(job)
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
func (sub *subscription) onlyFewAcks() bool {
	p := &sub.writes.pending
	return len(p.acks) < ackBatchMin && len(p.returns)+len(p.holds)+len(p.dead) == 0 &&
		p.renew == nil && len(sub.claims.lost) == 0 && !sub.drain.stopping
}

// onWritten applies what the completer wrote: finished rows leave the
// owner's hands, lost leases are reported, the rest is retried.
func (sub *subscription) onWritten(r writeResult) {
	sub.writes.inWrite = false
	job := r.job
	for _, d := range job.acks {
		if r.left.has(d) {
			continue // not written yet: stays pending
		}
		if sub.finish(d, r, "ack") {
			sub.s.obs.observe(Event{Kind: EventAcked, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Path: PathLease})
		}
	}
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
			d.expiresAt = at(r.sent).add(sub.cfg.Lease)
			sub.s.obs.observe(Event{Kind: EventRetried, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries})
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
		sub.onReleasedClaims(len(job.releaseTokens), r.releaseErr)
	}

	if r.err != nil {
		// The unwritten rest goes first next time.
		sub.writes.pending = r.left.merge(sub.writes.pending)
		if sub.drain.stopping && !sub.writes.finalDeadline.IsZero() {
			sub.writes.finalFailures++
		}
		wait := sub.writes.gate.failed(time.Now())
		sub.logger.Error("Writing acks and lease returns failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String()})
		return
	}
	if r.releaseErr != nil && len(sub.claims.lost) > 0 {
		// Only the release failed: retry it after a backoff too, not at
		// once in a loop.
		if sub.drain.stopping && !sub.writes.finalDeadline.IsZero() {
			sub.writes.finalFailures++
		}
		sub.writes.gate.failed(time.Now())
		return
	}
	sub.writes.gate.succeeded()
}

// onReleasedClaims applies the release of the first n lost claims. Once it
// is written, claims go on, from the start. While it fails, a lost claim
// whose rows' leases have expired anyway is given up on: the expired
// branch of any claim takes those rows.
func (sub *subscription) onReleasedClaims(n int, err error) {
	done := n
	if err != nil {
		done = 0
		for done < n && time.Since(sub.claims.lost[done].at) > sub.cfg.Lease {
			done++
		}
		sub.logger.Error("Releasing the rows of a failed claim failed; retrying", err, watermill.LogFields{"claims": n})
	}
	if done == 0 {
		return
	}
	sub.claims.lost = sub.claims.lost[done:]
	sub.claims.givingBack -= done
	sub.claims.scan.restart(true)
	sub.claims.want = true
}

// finish ends d's time in the owner's hands after its write, and reports
// whether the write applied; a write that did not apply is a lost lease,
// or a row abandoned because its write cannot succeed.
func (sub *subscription) finish(d *delivery, r writeResult, phase string) bool {
	delete(sub.hand.rows, d)
	d.state = finished
	sub.keyEnded(d)
	if err, ok := r.abandoned[d]; ok {
		sub.logger.Error("Cannot write this row's ack, nack or dead-letter move; it comes back when its lease expires", err,
			watermill.LogFields{"event": "write_abandoned", "row_id": d.id, "deliveries": d.deliveries})
		return false
	}
	if r.done.has(d) {
		return true
	}
	sub.leaseLost(d, phase)
	return false
}

// keyEnded: a row with an ordering key was written (acked, nacked,
// dead-lettered) or left our hands, so the next row of its key may be
// claimable now. It may lie behind the cursor (the scan passed it while
// its predecessor was present): the next claim asks for the key's next
// row by its key.
func (sub *subscription) keyEnded(d *delivery) {
	if d.orderingKey == "" || sub.drain.stopping {
		return
	}
	sub.claims.endedKeys[d.orderingKey] = struct{}{}
	sub.claims.want = true
	sub.claims.idleUntil = time.Time{}
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
			sub.logger.Error("Renewing leases failed; retrying every second until it works", r.err, watermill.LogFields{"rows": len(rows)})
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
}

// dropLost ends a row someone else holds now (phase: what found out): it
// ends here, and nothing is written for it. A handed-out message's handler
// is told to stop.
func (sub *subscription) dropLost(d *delivery, phase string) {
	sub.leaseLost(d, phase)
	if sub.hand.ready == d {
		sub.endMessage(d)
		sub.hand.ready = nil
	}
	if d.state == handedOut {
		sub.stopWatching(d)
		sub.endMessage(d)
		sub.hand.handed--
	}
	if sub.hand.retry == d {
		sub.hand.retry = nil
	}
	delete(sub.hand.rows, d)
	d.state = finished
}

// leaseLost reports a row whose lease token no longer matches: its lease
// expired and another consumer claimed it (or an operator removed it). The
// write was not applied; the other holder completes the row.
func (sub *subscription) leaseLost(d *delivery, phase string) {
	logWarn(sub.logger, "Lease lost: the row was reclaimed by another consumer; this write was not applied", watermill.LogFields{
		"event": "lease_lost", "phase": phase, "row_id": d.id, "deliveries": d.deliveries,
	})
	sub.s.obs.observe(Event{Kind: EventLeaseLost, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, RowID: d.id, Deliveries: d.deliveries, Phase: phase})
}
