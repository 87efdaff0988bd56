package pgoutbox

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/handoff"
	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// subscription is one Subscribe call. One goroutine, the owner (run), holds
// all of its state: the prefetch buffer, the rows handed out, the claim
// cursor, the verdicts waiting to be written, and every decision to renew,
// give back or release a lease. Everything else reports to it over
// channels and keeps no state of the subscription:
//
//   - a claim goroutine runs one claim statement at a time (claim.go) and
//     sends the rows back on claimed;
//   - a watcher goroutine per handed-out message waits for its Ack or Nack
//     and sends the verdict on verdicts;
//   - the completer (completer.go) writes the batches the owner gives it
//     and sends back which (row, token) pairs it wrote.
//
// Nothing is shared under a lock, so there is no lock order to get wrong,
// and one row is in exactly one state (deliveryState) at a time.
type subscription struct {
	s      *Subscriber
	cfg    *SubscriberConfig
	topic  string
	ctx    context.Context // the Subscribe ctx: parent of message contexts
	out    chan *message.Message
	logger watermill.LoggerAdapter
	waiter *notifier.Waiter

	verdicts   verdictInbox
	slots      chan slotItem // MaxInFlight > 1: messages for the slots to hand out
	slotStop   chan struct{} // closed when stopping: slots hand out nothing more
	slotsDone  sync.WaitGroup
	verdictBuf []verdict
	reports    chan report // results of the claim goroutine and the completer
	comp       *completer

	// stopCtx ends when the subscription stops: reads that only plan
	// (NextDue) stop waiting for the database then.
	stopCtx    context.Context
	cancelStop context.CancelFunc
	done       chan struct{} // closed when run returns

	// The owner's state; only run and the methods it calls touch it.
	held      map[*delivery]struct{} // every row we lease, in any state but finished
	buffer    []*delivery            // claimed, not handed out, in queue order
	ready     *delivery              // taken from the buffer (or the retry) and prepared: goes out next
	single    *delivery              // MaxInFlight 1: the message in flight, whose Ack the owner waits for itself
	handed    int                    // handed out, waiting for a verdict
	retry     *delivery              // ordered mode: a nacked row delivered again at retryAt
	pending   writeJob               // verdicts and releases not yet given to the completer
	inWrite   bool                   // the completer has a job
	writeWait time.Time              // after a failed write: not before then
	writeBO   *backoff.ExponentialBackOff
	pf        prefetch
	scan      claimScan

	claiming         bool
	lookAgain        time.Duration // next look after a publisher's wake-up, 0: none (see onNotified)
	wokeDuringClaim  bool          // something woke us while the claim ran: an empty claim may have missed it
	wantClaim        bool          // claim when there is room: the last claim found rows, or something woke us
	claimWait        time.Time     // after a failed claim: not before then
	claimBO          *backoff.ExponentialBackOff
	gen              uint64 // bumped by every give-back; a claim started before it gives its rows back too
	givingBack       int    // give-backs not written yet: a claim now would overtake them
	idleUntil        time.Time
	endedKeys        map[string]struct{} // ordering keys whose rows ended since the last claim
	idlePoll         time.Duration
	nextRenew        time.Time
	renewFailing     bool
	lostClaims       []claimToken // claims whose reply was lost; their rows go back (ReleaseClaim)
	stopping         bool
	drainOver        bool
	finalDeadline    time.Time // set when only the last writes remain
	finalFailures    int
	timer            *time.Timer
	timerAt          time.Time
	nextHousekeeping time.Time
	drainEnd         time.Time
	lastWrite        time.Time // when the last write was started
	ackWait          time.Time // a paced write of acks is due then

	batches      []*heldBatch // held claims' batches not ended yet (held.go), oldest first
	txSeen       bool         // a handler completed its row in its own transaction (ClaimAuto leases then)
	busy         bool         // the last claim found rows (ClaimAuto holds only then)
	heldOffUntil time.Time    // ClaimAuto leases until then: the handlers were slow
	// heldFailedUntil: every mode leases until then, a batch's end failed.
	heldFailedUntil time.Time
	poolClosed      bool // the pool was closed: the subscription ends (pool_closed.go)
}

// report is what the claim goroutine, the completer or forwardSignals
// sends the owner: one channel for all keeps the owner's select small.
type report struct {
	claim *claimResult
	write *writeResult
	batch *batchResult
	stop  bool // the Subscribe context ended or the Subscriber closes
	// none of them: the notifier woke the subscription (waiter.Take says why)
}

// forwardSignals turns the notifier's wake-ups and the stop signals into
// reports, until ended closes.
func (sub *subscription) forwardSignals(ended <-chan struct{}) {
	stop, closing := sub.ctx.Done(), sub.s.closing
	for {
		var r report
		select {
		case <-ended:
			return
		case <-sub.waiter.C:
		case <-stop:
			r.stop, stop, closing = true, nil, nil
		case <-closing:
			r.stop, stop, closing = true, nil, nil
		}
		select {
		case sub.reports <- r:
		case <-ended:
			return
		}
	}
}

// verdict is a handler's answer for a delivery, sent by its watcher.
type verdict struct {
	d        *delivery
	seq      uint32           // the hand-out it answers: a late answer of an earlier one is ignored
	msg      *message.Message // the message handed out (its metadata after the handler)
	poison   error            // the row did not decode (a slot found out)
	ack      bool
	unsent   bool // the subscription stopped before the Router took the message
	timedOut bool // no Ack or Nack within AckDeadline
	// converted, when set, is no verdict: a handler's transaction wants to
	// delete this held row, so make it a lease now, and close converted
	// once it is one.
	converted chan struct{}
}

func newSubscription(s *Subscriber, ctx context.Context, topic string, waiter *notifier.Waiter) *subscription {
	now := time.Now()
	sub := &subscription{
		s:         s,
		cfg:       &s.cfg,
		topic:     topic,
		ctx:       ctx,
		out:       make(chan *message.Message),
		logger:    s.logger.With(watermill.LogFields{"topic": topic}),
		waiter:    waiter,
		verdicts:  verdictInbox{wake: make(chan struct{}, 1)},
		reports:   make(chan report, 3+maxHeldBatches), // one claim, one write, one signal and the held batches' ends
		held:      map[*delivery]struct{}{},
		endedKeys: map[string]struct{}{},
		writeBO:   newBackoff(),
		claimBO:   newBackoff(),
		pf:        newPrefetch(s.cfg.MaxInFlight, s.cfg.MaxDeliveries == 0, now),
		scan:      newClaimScan(),
		idlePoll:  s.cfg.MinPollInterval,
		nextRenew: now.Add(s.cfg.Lease / 2),
		wantClaim: true,
	}
	sub.stopCtx, sub.cancelStop = context.WithCancel(context.Background())
	sub.done = make(chan struct{})
	if s.cfg.MaxInFlight > 1 {
		// The whole lease window fits: slots take the next message
		// without waiting for the owner, as the claim fills the queue.
		sub.slots, sub.slotStop = make(chan slotItem, s.cfg.MaxInFlight+maxPrefetch), make(chan struct{})
	}
	sub.comp = newCompleter(s.pool, s.q, &s.cfg, topic, sub.reports)
	sub.timer = time.NewTimer(time.Hour)
	sub.timer.Stop()
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
	ended := make(chan struct{})
	defer close(ended)
	defer close(sub.done)
	go sub.forwardSignals(ended)
	if sub.cfg.MaxInFlight > 1 {
		for range sub.cfg.MaxInFlight {
			sub.slotsDone.Add(1)
			go sub.slot()
		}
	}
	sub.nextHousekeeping = time.Now().Add(housekeepingEvery(sub.cfg))
	fast := 0

	for {
		now := time.Now()
		sub.passedTimes(now)
		sub.startClaim(now)
		sub.startWrite(now)
		if sub.stopping && sub.finishedStopping(now) {
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
		if sub.single != nil {
			single = sub.single.msg
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
			case <-sub.verdicts.wake:
				sub.takeVerdicts()
				continue
			case <-ackC:
				sub.onVerdict(verdict{d: sub.single, seq: sub.single.seq, msg: single, ack: true}, false)
				continue
			case <-nackC:
				sub.onVerdict(verdict{d: sub.single, seq: sub.single.seq, msg: single}, false)
				continue
			default:
			}
		}
		fast = 0
		sub.armTimer(now)

		select {
		case sendC <- msg:
			sub.handedOut(head)
		case <-sub.verdicts.wake:
			sub.takeVerdicts()
		case <-ackC:
			sub.onVerdict(verdict{d: sub.single, seq: sub.single.seq, msg: single, ack: true}, false)
		case <-nackC:
			sub.onVerdict(verdict{d: sub.single, seq: sub.single.seq, msg: single}, false)
		case r := <-sub.reports:
			poolClosed := sub.poolClosedBy(r)
			switch {
			case r.claim != nil:
				sub.onClaimed(*r.claim)
			case r.write != nil:
				sub.onWritten(*r.write)
			case r.batch != nil:
				sub.finishedBatch(*r.batch)
			case r.stop:
				if !sub.stopping {
					sub.beginStop()
				}
			default:
				sub.onNotified(sub.waiter.Take())
			}
			if poolClosed && !sub.stopping {
				sub.beginStop()
			}
		case <-sub.timer.C:
			sub.timerAt = time.Time{} // passedTimes acts on it
		}
	}
	if sub.slots != nil {
		close(sub.slots)
		sub.slotsDone.Wait() // none sends on out any more
	}
	sub.waiter.Stop()
	close(sub.out)
	sub.logger.Debug("Subscription closed", nil)
}

// onNotified handles what the notifier reported: rows due, rows scheduled
// (an empty claim plans the sleep anew, NextDue), rows another subscriber
// of this group returned, or a vanished liveness lock (look for orphaned
// rows).
func (sub *subscription) onNotified(k notifier.Kinds) {
	if k.Orphans {
		sub.scan.findOrphans = true
	}
	if k.Vanished {
		// A process may have died: the rows of its held transactions are
		// due again, behind a busy loop's cursor.
		sub.scan.restart(false)
	}
	if k.Due {
		// Publishers notify once per cooldown (PublisherConfig.
		// NotifyCooldown): rows of the quiet publishes right after this
		// one are found by a look again shortly after.
		sub.lookAgain = lookAgainFirst
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
	if sub.claiming {
		sub.wokeDuringClaim = true
	}
	if !sub.wantClaim && !sub.scan.resume {
		sub.scan.restart(expired)
	}
	sub.scan.resume = false
	sub.wantClaim = true
	sub.idleUntil = time.Time{}
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
	earliest(sub.idleUntil)
	earliest(sub.nextHousekeeping)
	earliest(sub.drainEnd)
	earliest(sub.writeWait)
	earliest(sub.ackWait)
	earliest(sub.claimWait)
	for _, b := range sub.batches {
		if !b.closing {
			earliest(b.deadline)
		}
	}
	if len(sub.batches) >= maxHeldBatches {
		earliest(sub.batches[0].claimedAt.Add(heldPatience)) // see batchesBusy
	}
	if sub.retry != nil && sub.retry.holdDone {
		earliest(sub.retry.retryAt.time())
	}
	if at.Equal(sub.timerAt) {
		return
	}
	sub.timer.Stop()
	sub.timerAt = at
	if !at.IsZero() {
		sub.timer.Reset(at.Sub(now))
	}
}

// passedTimes acts on the timed events that are due: the end of an idle
// sleep, of a backoff, of the drain, and housekeeping.
func (sub *subscription) passedTimes(now time.Time) {
	if !sub.idleUntil.IsZero() && !now.Before(sub.idleUntil) {
		sub.wake(true) // the sleep may have been set to a lease expiry
	}
	if !sub.claimWait.IsZero() && !now.Before(sub.claimWait) {
		sub.claimWait = time.Time{}
	}
	if !sub.writeWait.IsZero() && !now.Before(sub.writeWait) {
		sub.writeWait = time.Time{}
	}
	if !now.Before(sub.nextHousekeeping) {
		sub.housekeeping(now)
		sub.nextHousekeeping = now.Add(housekeepingEvery(sub.cfg))
	}
	if !sub.drainEnd.IsZero() && !now.Before(sub.drainEnd) {
		sub.drainEnd = time.Time{}
		sub.endDrain()
	}
	if len(sub.batches) > 0 {
		sub.tendBatches(now)
	}
}

// unjudged is the number of leased rows without a verdict: the lease window.
func (sub *subscription) unjudged() int {
	n := len(sub.buffer) + sub.handed
	if sub.ready != nil {
		n++
	}
	return n
}

// takeBuffer empties the buffer, the prepared message first, in order.
func (sub *subscription) takeBuffer() []*delivery {
	buf := sub.buffer
	if sub.ready != nil {
		buf = append([]*delivery{sub.ready}, buf...)
	}
	sub.buffer, sub.ready = nil, nil
	return buf
}

// backpressured reports whether verdicts wait to be written in such numbers
// that the subscription should neither claim nor hand out more: a
// completion path that cannot write would otherwise let it lease ever more
// rows, and a crash would redeliver them all.
func (sub *subscription) backpressured() bool {
	return sub.pending.ops()+sub.comp.writing() >= maxPendingCompletions
}

// maxPendingCompletions bounds the verdicts not yet written per
// subscription, so a crashed process leaves at most MaxInFlight +
// maxPendingCompletions handled but unacked messages behind.
const maxPendingCompletions = 256

// startClaim starts a claim when one is wanted and there is room.
func (sub *subscription) startClaim(now time.Time) {
	switch {
	case sub.claiming, sub.stopping, !sub.wantClaim, sub.givingBack > 0, sub.retry != nil,
		!sub.claimWait.IsZero(), sub.backpressured():
		return
	}
	if sub.batchesBusy(now) {
		return // a batch ends soon: claim on the held path then
	}
	floor := 0
	if now.Before(sub.scan.keyedUntil) { // keyed rows seen, not just a slow claim
		floor = maxClaim // hold many keys: see claimSizeAtLeast
	}
	n := sub.pf.claimSizeAtLeast(sub.unjudged(), now, floor)
	if n == 0 {
		return
	}
	sub.claiming = true
	req := sub.scan.request(n, sub.gen, now)
	req.holder = sub.holder()
	if len(sub.endedKeys) > 0 {
		req.window = max(2*n, minScanWindow) // "heads" is in the windowed claim only
		for k := range sub.endedKeys {
			req.endedKeys = append(req.endedKeys, k)
		}
		clear(sub.endedKeys)
	}
	if sub.scan.findOrphans {
		// Not before the notifier made two checks: until then it cannot
		// tell a dead holder from a reconnecting one.
		if spare, ok := sub.waiter.Spare(); ok {
			req.orphansOf = spare
		}
	}
	run := sub.runClaim
	if sub.wantHeld(req, now) {
		req.held, run = true, sub.runHeldClaim
	}
	go func() {
		r := run(req)
		sub.reports <- report{claim: &r}
	}()
}

// holder is what this process's rows are stamped with: its liveness key
// while it holds the lock, else NULL (liveness unknown: lease expiry only).
func (sub *subscription) holder() pgtype.Int8 {
	key, live := sub.waiter.Liveness()
	return pgtype.Int8{Int64: key, Valid: live && key != 0}
}

// onClaimed takes a claim's rows into the buffer.
func (sub *subscription) onClaimed(r claimResult) {
	sub.claiming = false
	woke := sub.wokeDuringClaim
	sub.wokeDuringClaim = false
	now := time.Now()
	if r.err != nil && r.req.held {
		// The transaction rolled back (or its connection is closed, which
		// the server rolls back): nothing to give back.
		for _, k := range r.req.endedKeys {
			sub.endedKeys[k] = struct{}{}
		}
		wait := sub.claimBO.NextBackOff()
		sub.claimWait = now.Add(wait)
		sub.logger.Error("Claim failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String(), "path": PathHeld})
		return
	}
	if r.err != nil {
		// The statement may have committed: its rows would stay leased
		// under a token nobody holds. Give them back (ReleaseClaim) instead
		// of letting them wait for the lease, and without counting a
		// delivery nobody saw. Like any give-back, claims wait for it and
		// then scan from the start, so the rows keep their place.
		sub.lostClaims = append(sub.lostClaims, claimToken{token: r.req.token, at: r.req.sent})
		for _, k := range r.req.endedKeys { // that claim did not happen
			sub.endedKeys[k] = struct{}{}
		}
		sub.givingBack++
		sub.gen++
		if r.req.orphansOf != nil {
			sub.scan.findOrphans = true // that look did not happen
		}
		wait := sub.claimBO.NextBackOff()
		sub.claimWait = now.Add(wait)
		sub.logger.Error("Claim failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String()})
		return
	}
	sub.claimBO.Reset()
	sub.claimWait = time.Time{}
	sub.busy = len(r.rows) > 0
	sub.scan.claimed(r)
	if len(r.req.endedKeys) > 0 && (len(r.rows) >= r.req.n || r.reclaimed > 0) {
		// The claim was full: the next rows of some ended keys may not have
		// fit. Ask again for the keys that got none.
		got := map[string]bool{}
		for _, d := range r.rows {
			got[d.orderingKey] = true
		}
		for _, k := range r.req.endedKeys {
			if !got[k] {
				sub.endedKeys[k] = struct{}{}
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
		sub.held[d] = struct{}{}
	}
	if b := r.batch; b != nil {
		b.claimedAt, b.deadline = r.req.sent, sub.bound(r.req.sent)
		sub.batches = append(sub.batches, b)
	}
	if sub.stopping || r.req.gen != sub.gen {
		// Stopping, or rows went back while this claim ran: these rows may
		// be newer than those, so they go back too, and the next claim
		// takes everything from the start, in order.
		sub.giveBack(r.rows)
		return
	}
	sub.buffer = append(sub.buffer, r.rows...)
	if len(r.rows) > 0 {
		sub.wantClaim, sub.idlePoll = true, sub.cfg.MinPollInterval
		if sub.lookAgain > 0 {
			// Still busy after a publisher's wake-up: quiet publishes may
			// keep coming, keep looking again after the claims run dry.
			sub.lookAgain = lookAgainFirst
		}
		return
	}
	if woke {
		// The wake-up may announce a row committed after this claim's
		// snapshot: claim again instead of sleeping.
		sub.scan.restart(false)
		sub.wantClaim = true
		return
	}
	if r.cursor.Valid && r.free > 0 {
		// Competitors' claims had locked the rows of the window: the
		// cursor moved past them, go on at once.
		sub.wantClaim = true
		return
	}
	if r.cursor.Valid {
		// Every row of the window waits for its key (held here or by a
		// competitor): go on from the cursor after the shortest idle wait,
		// so a backlog of held keys is read one window per wait, not at
		// claim speed. An ended key's next row is asked for directly.
		sub.scan.resume = true
		sub.wantClaim = false
		sub.idleUntil = now.Add(sub.cfg.MinPollInterval)
		return
	}
	sub.wantClaim = false
	var wait time.Duration
	if sub.lookAgain > 0 && sub.lookAgain < sub.idlePoll && sub.lookAgain <= lookAgainLast {
		wait = sub.lookAgain
		sub.lookAgain *= 2
	} else {
		sub.lookAgain = 0
		wait = jitter(sub.idlePoll)
		sub.idlePoll = min(sub.idlePoll*2, sub.cfg.MaxPollInterval)
	}
	if r.dueIn > 0 && r.dueIn < wait {
		wait = r.dueIn
	}
	sub.idleUntil = now.Add(wait)
}

// nextMessage returns the delivery to hand out next, with the output
// channel to send it on, or a nil channel when nothing may go out now. Rows
// that must not go out (lease likely gone, too many deliveries,
// undecodable) are dealt with on the way.
func (sub *subscription) nextMessage(now time.Time) (*delivery, chan *message.Message) {
	if sub.stopping || sub.backpressured() {
		return nil, nil
	}
	full := sub.handed >= sub.maxHandedOut()
	if d := sub.retry; d != nil {
		if !d.holdDone || at(now) < d.retryAt || full {
			return nil, nil // ordered: nothing overtakes the retry
		}
		if r := sub.ready; r != nil { // prepared before the nack: back in front
			sub.ready = nil
			sub.buffer = append([]*delivery{r}, sub.buffer...)
		}
		sub.retry = nil
		d.state = buffered
		d.deliveries++ // the hold counted this delivery
		// A handler past its ack deadline may still hold the payload.
		d.payload = bytes.Clone(d.payload)
		d.claimedAt = at(now) // the stalled-buffer check measures from here
		if sub.prepare(d, now) {
			sub.ready = d
		}
	}
	// The next message is prepared while the current one is in flight, so
	// a verdict is followed by the next hand-out at once.
	for sub.ready == nil && len(sub.buffer) > 0 {
		d := sub.buffer[0]
		sub.buffer[0] = nil
		sub.buffer = sub.buffer[1:]
		switch {
		case d.state == finished: // lease lost while buffered
		case d.msg != nil: // prepared already, then put back
			sub.ready = d
		case sub.prepare(d, now):
			sub.ready = d
		}
	}
	if sub.ready == nil || full {
		return nil, nil
	}
	return sub.ready, sub.out
}

// prepare admits d and builds its message (MaxInFlight 1: the owner hands
// it out itself), or sends d where it belongs instead and returns false.
func (sub *subscription) prepare(d *delivery, now time.Time) bool {
	if !sub.admit(d, now) {
		return false
	}
	d.outcome = newOutcome(d, sub.s.q.CompleteInTx, sub.unholder(d))
	msg, cancel, err := buildMessage(sub.ctx, d.uuid, d.payload, d.metaRaw, d.orderingKey, d.outcome)
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

// buildMessage decodes a row into the message handed to the Router, with a
// context (derived from the Subscribe context) that carries the outcome.
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
	sub.ready = nil
	d.state, d.handedAt = handedOut, at(time.Now())
	d.seq++
	sub.handed++
	if sub.slots == nil {
		sub.single = d
		return
	}
	d.outcome, d.stopWatch = newOutcome(d, sub.s.q.CompleteInTx, sub.unholder(d)), make(chan struct{})
	// Never blocks: see maxHandedOut.
	sub.slots <- slotItem{d: d, seq: d.seq, uuid: d.uuid, payload: d.payload, metaRaw: d.metaRaw, orderingKey: d.orderingKey,
		outcome: d.outcome, stop: d.stopWatch}
}

// takeQueued takes back the deliveries in the slots' queue that no slot
// took yet, in queue order; they count as handed out no more.
func (sub *subscription) takeQueued() []*delivery {
	var out []*delivery
	for sub.slots != nil {
		select {
		case it := <-sub.slots:
			it.d.state = buffered
			sub.handed--
			out = append(out, it.d)
			continue
		default:
		}
		break
	}
	return out
}

// oldestHandedOut is how long ago the oldest delivery still handed out
// went to the slots.
func (sub *subscription) oldestHandedOut(now time.Time) time.Duration {
	var oldest time.Duration
	for d := range sub.held {
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
		return cap(sub.slots)
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
	for sub.handed < cap(sub.slots) && !sub.stopping && !sub.backpressured() && len(sub.buffer) > 0 {
		d := sub.buffer[0]
		sub.buffer[0] = nil
		sub.buffer = sub.buffer[1:]
		if d.state != finished && sub.admit(d, now) {
			sub.handedOut(d) // the slot builds the message
		}
	}
}

// slotItem is a delivery for a slot, with what the slot may read of it.
type slotItem struct {
	d                *delivery // only passed back in the verdict
	seq              uint32
	uuid             string
	payload, metaRaw []byte
	orderingKey      string
	outcome          *outcome
	stop             <-chan struct{} // closed when the owner stops waiting for the verdict
}

// slot is one of MaxInFlight goroutines that hand messages to the Router and
// report their verdicts. It reads nothing of a delivery but what its
// slotItem carries. A message not yet taken by the Router when the
// subscription stops is reported unsent, and given back.
func (sub *subscription) slot() {
	defer sub.slotsDone.Done()
	// The slot waits for the verdict, so it keeps the ack deadline.
	var deadline *time.Timer
	var expired <-chan time.Time
	if sub.cfg.AckDeadline > 0 {
		deadline = time.NewTimer(sub.cfg.AckDeadline)
		deadline.Stop()
		defer deadline.Stop()
		expired = deadline.C
	}
	for it := range sub.slots {
		v := verdict{d: it.d, seq: it.seq}
		msg, cancel, err := buildMessage(sub.ctx, it.uuid, it.payload, it.metaRaw, it.orderingKey, it.outcome)
		if err != nil {
			v.poison = err
			sub.verdicts.put(v)
			continue
		}
		v.msg = msg
		select {
		case <-sub.slotStop:
			v.unsent = true
		default:
			select {
			case sub.out <- msg:
				if deadline != nil {
					deadline.Reset(sub.cfg.AckDeadline)
				}
			wait:
				select {
				case <-msg.Acked():
					v.ack = true
				case <-msg.Nacked():
				case <-expired:
					if it.outcome.completingInTx() {
						// The handler's transaction is completing the row
						// (bounded by its commit timeout): its answer
						// decides, a nack now would only race it.
						expired = nil
						goto wait
					}
					v.timedOut = true
				case <-it.stop:
				}
				if deadline != nil {
					deadline.Stop()
				}
			case <-sub.slotStop:
				v.unsent = true
			case <-it.stop:
			}
		}
		cancel() // an answer, a deadline or a stop ends the message's context
		select {
		case <-it.stop: // the owner stopped waiting: it wants no verdict
		default:
			sub.verdicts.put(v)
		}
	}
}

// verdictInbox is where the slots leave verdicts for the owner: a mailbox,
// so a busy owner takes the verdicts of many messages per wake-up instead
// of being woken for each.
type verdictInbox struct {
	mu   sync.Mutex
	list []verdict
	wake chan struct{} // a value while the list is not empty
}

func (in *verdictInbox) put(v verdict) {
	in.mu.Lock()
	in.list = append(in.list, v)
	in.mu.Unlock()
	select {
	case in.wake <- struct{}{}:
	default:
	}
}

func (in *verdictInbox) take(buf []verdict) []verdict {
	in.mu.Lock()
	buf = append(buf[:0], in.list...)
	in.list = in.list[:0]
	in.mu.Unlock()
	return buf
}

// takeVerdicts applies the verdicts the slots reported.
func (sub *subscription) takeVerdicts() {
	sub.verdictBuf = sub.verdicts.take(sub.verdictBuf)
	for _, v := range sub.verdictBuf {
		if v.converted != nil {
			sub.unhold(v)
			continue
		}
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
	if sub.single == d {
		sub.single = nil
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
	if sub.single == d {
		sub.single = nil
	}
	sub.handed--
	if v.unsent {
		// The Router never took it: it goes back as if never handed out.
		sub.giveBack([]*delivery{d})
		return
	}
	sub.pf.verdicts(1)
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
		delete(sub.held, d)
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
		sub.pending.acks = append(sub.pending.acks, d)
		return
	}
	n := sub.decideNack(d, v.msg, timedOut)
	switch {
	case n.deadReason != "":
		sub.deadLetter(d, n.deadReason, n.errText)
	case sub.ordered() && !sub.stopping:
		// Ordered: the row stays ours and goes out again before anything
		// later, after its delay. The buffer goes back meanwhile, in order,
		// rather than sit leased through a long delay.
		d.state, d.retryAt, d.holdDone = retrying, at(time.Now()).add(n.delay), false
		if n.meta != nil {
			d.metaRaw = n.meta // as the hold stores it
		}
		sub.retry = d
		job := sub.jobFor(d)
		job.holds = append(job.holds, holdOp{d: d, err: textOrNull(n.errText), meta: metaOrNull(n.meta)})
		if n.delay > 0 {
			sub.giveBack(sub.takeBuffer())
			sub.gen++ // a claim under way gives its rows back too
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
	sub.gen++
	sub.scan.restart(false)
	sub.wantClaim = true
	for _, d := range ds {
		if d.state == finished {
			continue
		}
		sub.endMessage(d)
		d.state = writing
		sub.givingBack++
		if b := d.batch; b != nil {
			if b.closing { // becoming a lease: give that back after the commit
				b.deferred.returns = append(b.deferred.returns, returnOp{d: d, undo: 1, giveBack: true})
				continue
			}
			sub.decideHeld(d, heldReleased) // the commit drops its lock
			continue
		}
		sub.pending.returns = append(sub.pending.returns, returnOp{d: d, undo: 1, giveBack: true})
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
		for d := range sub.held {
			if d.state == handedOut && at(now).since(d.handedAt) >= sub.cfg.AckDeadline && !d.outcome.completingInTx() {
				sub.ackDeadlinePassed(d, d.msg)
			}
		}
	}
	// A prefetched row still waiting half a lease after its claim means the
	// handlers are stuck or slow: give the whole buffer back (all of it, so
	// the rows keep their order) for other consumers, rather than hold it.
	oldest := sub.ready
	if oldest == nil && len(sub.buffer) > 0 {
		oldest = sub.buffer[0]
	}
	if oldest != nil && at(now).since(oldest.claimedAt) > sub.cfg.Lease/2 {
		sub.giveBack(sub.takeBuffer())
	}
	if sub.slots != nil && len(sub.slots) > 0 && sub.oldestHandedOut(now) > sub.cfg.Lease/2 {
		// The same for the slots' queue: what no slot took yet goes back.
		sub.giveBack(sub.takeQueued())
	}
	if !now.Before(sub.nextRenew) && sub.pending.renew == nil {
		var rows []*delivery
		for d := range sub.held {
			// Rows with a write pending are left out: the write ends the
			// lease (or keeps it, a hold), and a renewal after it in the
			// same batch would find the row gone and call it lost.
			// Held rows have no lease to renew.
			if d.state != writing && !(d.state == retrying && !d.holdDone) && d.batch == nil {
				rows = append(rows, d)
			}
		}
		if len(rows) > 0 {
			sub.pending.renew, sub.pending.renewHolder = rows, sub.holder()
		}
		sub.nextRenew = now.Add(sub.cfg.Lease / 2)
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
	sub.stopping = true
	sub.cancelStop()
	queued := sub.takeQueued()
	if sub.slotStop != nil {
		close(sub.slotStop) // a slot holding a message reports it unsent
	}
	sub.giveBack(append(queued, sub.takeBuffer()...))
	if d := sub.retry; d != nil && d.holdDone {
		// Not delivered again yet: the hold counted that delivery.
		sub.retry = nil
		sub.giveBack([]*delivery{d})
	}
	if sub.cfg.DrainTimeout < 0 {
		sub.endDrain()
		return
	}
	sub.drainEnd = time.Now().Add(sub.cfg.DrainTimeout)
}

// endDrain stops waiting for handlers: the rows still handed out go back
// (under their tokens), never deleted; a late Ack is ignored.
func (sub *subscription) endDrain() {
	sub.drainOver = true
	for d := range sub.held {
		if d.state == handedOut {
			sub.stopWatching(d)
			sub.endMessage(d)
			sub.handed--
			sub.release(d)
		}
	}
}

// finishedStopping reports whether a stopping subscription may end: no
// handler to wait for, no claim under way, everything written, or the final
// writes given up on after their deadline.
func (sub *subscription) finishedStopping(now time.Time) bool {
	if sub.handed > 0 || sub.claiming || len(sub.batches) > 0 {
		return false
	}
	if sub.finalDeadline.IsZero() {
		sub.finalDeadline = now.Add(sub.cfg.StatementTimeout)
		sub.comp.setDeadline(sub.finalDeadline)
	}
	if sub.inWrite {
		return false
	}
	if sub.poolClosed {
		return true // nothing can be written any more
	}
	if sub.pending.empty() && len(sub.lostClaims) == 0 && sub.retry == nil {
		return true
	}
	if sub.finalFailures >= 3 || now.After(sub.finalDeadline) {
		sub.logger.Error("Giving up writing acks and lease returns at close; those rows are redelivered when their leases expire", nil,
			watermill.LogFields{"pending": sub.pending.ops()})
		return true
	}
	return false
}

// startWrite hands the pending verdicts to the completer when it is free.
func (sub *subscription) startWrite(now time.Time) {
	if sub.inWrite || !sub.writeWait.IsZero() {
		return
	}
	if sub.onlyFewAcks() && now.Sub(sub.lastWrite) < ackPacing {
		sub.ackWait = sub.lastWrite.Add(ackPacing) // armTimer wakes us then
		return
	}
	sub.ackWait, sub.lastWrite = time.Time{}, now
	job := sub.pending
	for _, c := range sub.lostClaims {
		job.releaseTokens = append(job.releaseTokens, c.token)
	}
	if job.empty() && len(job.releaseTokens) == 0 {
		return
	}
	sub.pending = writeJob{}
	sub.inWrite = true
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
	p := &sub.pending
	return len(p.acks) < ackBatchMin && len(p.returns)+len(p.holds)+len(p.dead) == 0 &&
		p.renew == nil && len(sub.lostClaims) == 0 && !sub.stopping
}

// onWritten applies what the completer wrote: finished rows leave the
// owner's hands, lost leases are reported, the rest is retried.
func (sub *subscription) onWritten(r writeResult) {
	sub.inWrite = false
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
			sub.givingBack--
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
			if sub.stopping {
				sub.retry = nil
				sub.giveBack([]*delivery{d})
			}
		default:
			if sub.retry == d {
				sub.retry = nil
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
		sub.pending = r.left.merge(sub.pending)
		if sub.stopping && !sub.finalDeadline.IsZero() {
			sub.finalFailures++
		}
		wait := sub.writeBO.NextBackOff()
		sub.writeWait = time.Now().Add(wait)
		sub.logger.Error("Writing acks and lease returns failed; retrying", r.err, watermill.LogFields{"retry_in": wait.String()})
		return
	}
	if r.releaseErr != nil && len(sub.lostClaims) > 0 {
		// Only the release failed: retry it after a backoff too, not at
		// once in a loop.
		if sub.stopping && !sub.finalDeadline.IsZero() {
			sub.finalFailures++
		}
		sub.writeWait = time.Now().Add(sub.writeBO.NextBackOff())
		return
	}
	sub.writeBO.Reset()
	sub.writeWait = time.Time{}
}

// onReleasedClaims applies the release of the first n lost claims. Once it
// is written, claims go on, from the start. While it fails, a lost claim
// whose rows' leases have expired anyway is given up on: the expired
// branch of any claim takes those rows.
func (sub *subscription) onReleasedClaims(n int, err error) {
	done := n
	if err != nil {
		done = 0
		for done < n && time.Since(sub.lostClaims[done].at) > sub.cfg.Lease {
			done++
		}
		sub.logger.Error("Releasing the rows of a failed claim failed; retrying", err, watermill.LogFields{"claims": n})
	}
	if done == 0 {
		return
	}
	sub.lostClaims = sub.lostClaims[done:]
	sub.givingBack -= done
	sub.scan.restart(true)
	sub.wantClaim = true
}

// finish ends d's time in the owner's hands after its write, and reports
// whether the write applied; a write that did not apply is a lost lease,
// or a row abandoned because its write cannot succeed.
func (sub *subscription) finish(d *delivery, r writeResult, phase string) bool {
	delete(sub.held, d)
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
	if d.orderingKey == "" || sub.stopping {
		return
	}
	sub.endedKeys[d.orderingKey] = struct{}{}
	sub.wantClaim = true
	sub.idleUntil = time.Time{}
}

// onRenewed applies a renewal's result: extended leases, lost ones.
func (sub *subscription) onRenewed(rows []*delivery, r writeResult) {
	if rows == nil {
		return
	}
	if !r.renewed {
		// Once per outage at ERROR; retried within a second, not a period,
		// or the leases would expire meanwhile.
		if !sub.renewFailing {
			sub.logger.Error("Renewing leases failed; retrying every second until it works", r.err, watermill.LogFields{"rows": len(rows)})
		}
		sub.renewFailing = true
		sub.nextRenew = time.Now().Add(min(time.Second, sub.cfg.Lease/10))
		return
	}
	sub.renewFailing = false
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
	if sub.ready == d {
		sub.endMessage(d)
		sub.ready = nil
	}
	if d.state == handedOut {
		sub.stopWatching(d)
		sub.endMessage(d)
		sub.handed--
	}
	if sub.retry == d {
		sub.retry = nil
	}
	delete(sub.held, d)
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

// newBackoff paces retries after database errors: 50ms doubling to 5s,
// with jitter, forever. Options, not fields: NewExponentialBackOff resets
// itself, so fields set afterwards would only apply after the next Reset.
func newBackoff() *backoff.ExponentialBackOff {
	return backoff.NewExponentialBackOff(backoff.WithInitialInterval(50*time.Millisecond),
		backoff.WithMaxInterval(5*time.Second), backoff.WithMaxElapsedTime(0))
}

// jitter spreads d by ±20% so idle subscribers do not poll in lockstep.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
