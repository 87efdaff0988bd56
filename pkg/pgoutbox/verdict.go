package pgoutbox

import (
	"errors"
	"fmt"
	"maps"
	"runtime/debug"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"
)

// maxErrorLen bounds last_error: some errors carry whole request bodies, and
// a poison row should not make every write of it, or the DLQ, heavy.
const maxErrorLen = 8 << 10

const truncatedMarker = "…[truncated]"

// nackDecision is what a Nack means for a delivery: a dead letter (with
// its reason) or a retry after delay. meta is the metadata to store, nil to
// keep what is stored.
type nackDecision struct {
	deadReason string
	errText    string
	delay      time.Duration
	meta       []byte
}

// decideNack applies Reject, the retry policy and a handler-chosen delay to
// a nacked delivery. A delay set on the message by Watermill's DelayOnError
// (or delay.Message) wins over the policy's, and is remembered under
// retryDelayKey so DelayOnError's multiplier grows it next time. A
// delivery that ran past its ack deadline is judged on the stored metadata
// only: its handler may still be running and writing to the message.
func (sub *subscription) decideNack(d *delivery, msg *message.Message, timedOut bool) nackDecision {
	rejectReason, handlerErr := d.outcome.get()
	var n nackDecision
	if handlerErr != nil {
		n.errText = boundError(handlerErr.Error())
	}
	// The error the handler returned decides, when ErrorRecorder handed it
	// over: a Reject whose error the handler did not return (it handled
	// it and failed otherwise) is not one, and an error wrapping
	// ErrRejected is one. Without it, only Reject's mark on the message
	// tells.
	rejected := rejectReason != ""
	if handlerErr != nil {
		rejected = errors.Is(handlerErr, ErrRejected)
	}
	if rejected && !timedOut {
		n.deadReason = ReasonRejected
		if n.errText == "" {
			n.errText = boundError("rejected: " + rejectReason)
		}
		return n
	}
	after, retry := sub.nextDelay(d, handlerErr)
	if !retry {
		n.deadReason = ReasonRetryExhausted
		return n
	}
	n.delay = retryDelay(after)
	if timedOut {
		return n
	}
	stored := message.Metadata{}
	if decodeMetadata(d.metaRaw, stored) != nil {
		return n
	}
	// The row keeps the metadata it was published with, as a broker
	// redelivers what was published: what a handler or middleware wrote
	// into the message (PoisonQueue's reason keys on a failed publish,
	// scratch keys) is not stored. Only the delay the handler's side chose
	// is (DelayOnError's, under retryDelayKey).
	delete(stored, delay.DelayedForKey)
	delete(stored, delay.DelayedUntilKey)
	next := maps.Clone(stored)
	delete(next, retryDelayKey)
	// The message was handed out without a "delayed until" key, so one now
	// means the handler's side chose when to retry: its duration wins.
	if _, ok := msg.Metadata[delay.DelayedUntilKey]; ok {
		if v := msg.Metadata.Get(delay.DelayedForKey); v != "" {
			if dd, err := time.ParseDuration(v); err == nil {
				n.delay = retryDelay(dd)
				next[retryDelayKey] = v
			}
		}
	}
	if !maps.Equal(stored, next) {
		n.meta, _, _ = appendMetadataJSON(nil, 0, sanitizeMetadata(next))
	}
	return n
}

// sanitizeText makes s storable as PostgreSQL text: invalid UTF-8 becomes
// U+FFFD and NUL bytes are dropped. Text the subscriber writes on its own
// (handler errors) must never fail the batched
// statement it travels in, or one bad message would stop every ack.
func sanitizeText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "")
}

func sanitizeMetadata(md message.Metadata) message.Metadata {
	out := make(message.Metadata, len(md))
	for k, v := range md {
		out[sanitizeText(k)] = sanitizeText(v)
	}
	return out
}

// boundError makes s storable (sanitizeText) and cuts it to maxErrorLen
// bytes at a rune boundary, marking the cut.
func boundError(s string) string {
	s = sanitizeText(s)
	if len(s) <= maxErrorLen {
		return s
	}
	cut := maxErrorLen - len(truncatedMarker)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + truncatedMarker
}

// logWarn logs at WARN where the logger has that level; Watermill's
// LoggerAdapter has none, so others get INFO with severity=warn.
func logWarn(l watermill.LoggerAdapter, msg string, fields watermill.LogFields) {
	if w, ok := l.(interface {
		Warn(string, watermill.LogFields)
	}); ok {
		w.Warn(msg, fields)
		return
	}
	l.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}

// textOrNull is s as a text parameter; empty means NULL (keep what is
// stored).
func textOrNull(s string) pgtype.Text {
	return pgtype.Text{String: s, Valid: s != ""}
}

func metaOrNull(meta []byte) pgtype.Text {
	return pgtype.Text{String: string(meta), Valid: meta != nil}
}

// retryDelay is a retry's delay as it is kept: none below zero, at most
// maxBackoffInterval (about 73 years). An ordered subscription adds it to
// its clock, where a policy's delay near the largest Duration wrapped to
// a time in the past: a redelivery at once, in a loop.
func retryDelay(d time.Duration) time.Duration { return min(max(d, 0), maxBackoffInterval) }

// delayOf is a retry delay as a microseconds parameter.
func delayOf(d time.Duration) pgtype.Int8 {
	return pgtype.Int8{Int64: max(d, 0).Microseconds(), Valid: true}
}

// takeVerdicts applies the verdicts the slots reported.
func (sub *subscription) takeVerdicts() {
	var unholds []unholdRequest
	sub.events.verdictBuf, unholds = sub.events.inbox.take(sub.events.verdictBuf)
	for _, r := range unholds {
		sub.unhold(r)
	}
	for _, v := range sub.events.verdictBuf {
		if v.timedOut {
			if v.d.state == handedOut && v.d.seq == v.seq {
				sub.ackDeadlinePassed(v.d, v.msg)
			} else {
				sub.lostHandlerTimedOut(v.d) // a lost row's slot stops waiting
			}
			continue
		}
		sub.onVerdict(v, false)
	}
	clear(sub.events.verdictBuf)
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
		// A late answer: the deadline, the drain or a lost row ended this
		// delivery (endRow); a lost row's handler has returned.
		sub.answeredLate(d)
		return
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
	sub.endMessage(d) // Ack and Nack end the message's context (Watermill's contract)
	if v.poison != nil {
		sub.poisoned(d, v.poison)
		return
	}
	if d.outcome.completedInTx() {
		// The handler's transaction deleted the row and committed (with
		// the handler's writes): acked, and nothing is left to write. A
		// Nack after that commit (a middleware outside failed) cannot
		// bring the row back.
		d.state = writing // its hand-out ended above
		sub.endRow(d)
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
	case sub.ordered() && !sub.drain.stopping && d.orderingKey == "":
		// Ordered: the row stays ours and goes out again before anything
		// later, after its delay. Not a keyed row: it holds back its key
		// only, as with more in flight (it goes back with its delay, and
		// the key's next row is not claimed before it ends). The buffer goes back meanwhile, in order,
		// rather than sit leased through a long delay.
		// A retry due at once is counted with the hold: no wait to crash
		// in (see nextMessage).
		dueAtOnce := n.delay <= 0
		d.state, d.retryAt, d.holdDone, d.counted = retrying, at(time.Now()).add(n.delay), false, dueAtOnce
		if n.meta != nil {
			d.metaRaw = n.meta // as the hold stores it
		}
		sub.hand.retry = d
		job := sub.jobFor(d)
		job.holds = append(job.holds, holdOp{d: d, err: textOrNull(n.errText), meta: metaOrNull(n.meta), counts: dueAtOnce})
		if n.delay > 0 {
			sub.giveBack(sub.hand.takeBuffer())
			sub.claims.gen++ // a claim under way gives its rows back too
		}
	default:
		d.state = writing
		delay := delayOf(n.delay)
		if sub.ordered() && sub.drain.stopping && d.orderingKey == "" {
			// Stopping: nobody here delivers it again, and a delay would
			// put it behind later messages. It keeps its place, as the
			// rows given back at the stop do; the next subscriber delivers
			// it first, without the delay. (A keyed row keeps its delay:
			// its key holds back what comes after it, wherever it is due.)
			delay = pgtype.Int8{}
		}
		job := sub.jobFor(d)
		job.returns = append(job.returns, returnOp{d: d, delay: delay,
			err: textOrNull(n.errText), meta: metaOrNull(n.meta)})
		if d.orderingKey != "" && delay.Valid {
			sub.claims.keys.dueAt(d.orderingKey, time.Now().Add(n.delay))
		}
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
	sub.claims.gaveBack()
	for _, d := range ds {
		if d.state == finished {
			continue
		}
		// The claim counted the delivery no handler saw: take it back. An
		// ordered retry's counted delivery ran, unless the retry's own
		// count was asked (see nextMessage).
		undo := int32(1)
		if d.state == retrying && !d.counted {
			undo = 0
		}
		sub.endMessage(d)
		d.state = writing
		sub.claims.givingBack++
		if b := d.batch; b != nil {
			if b.closing { // becoming a lease: give that back after the commit
				b.deferred.returns = append(b.deferred.returns, returnOp{d: d, undo: undo, giveBack: true})
				continue
			}
			sub.held.decide(d, heldReleased) // the commit drops its lock
			continue
		}
		sub.writes.pending.returns = append(sub.writes.pending.returns, returnOp{d: d, undo: undo, giveBack: true})
	}
}

// release returns a handed-out row whose verdict will not come (the drain is
// over): due again at once, its delivery counted.
func (sub *subscription) release(d *delivery) {
	d.state = writing
	job := sub.jobFor(d)
	job.returns = append(job.returns, returnOp{d: d})
}

// nextDelay asks the RetryPolicy about d's failed delivery. A policy that
// panics would take the process down at every delivery of the message,
// one process after the other: its panic is logged and the default policy
// answers instead.
func (sub *subscription) nextDelay(d *delivery, handlerErr error) (after time.Duration, retry bool) {
	defer func() {
		if r := recover(); r != nil {
			sub.logger.Error("RetryPolicy.NextDelay panicked; the default retry policy decides this delivery", fmt.Errorf("%v", r),
				watermill.LogFields{"row_id": d.id, "deliveries": d.deliveries, "stack": string(debug.Stack())})
			after, retry = DefaultRetryPolicy().NextDelay(d.deliveries, handlerErr)
		}
	}()
	return sub.cfg.RetryPolicy.NextDelay(d.deliveries, handlerErr)
}
