package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	backoff5 "github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/handoff"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// delivery is one claimed row, from its claim to its completion write. Only
// the subscription's owner goroutine reads or writes its fields once the
// claimer handed it over; the handler's side reaches it through outcome
// (handler error, rejection) and the watcher goroutine through stopWatch.
// Its parts are embedded: each is one concern of the owner's bookkeeping.
type delivery struct {
	claimedRow
	state deliveryState
	// ackUnanswered: an ack of it was sent and its reply lost, so it may
	// have been applied; a retry that finds the row gone most likely
	// finds that (finish).
	ackUnanswered bool
	seq           uint32  // counts hand-outs: a verdict names the one it answers
	claimedAt     instant // when the claim that took it was sent
	expiresAt     instant // our lease ends by then at the latest (sent time + Lease of the last write that set it)
	// stamp is the liveness key its row carries (lease_holder), as the
	// last write that set it committed; invalid: none. A row whose stamp
	// is not the process's current holder is renewed at once (see
	// housekeeping): a key that is no longer held makes it an orphan to
	// other processes, and no key leaves it to its lease after a crash.
	stamp pgtype.Int8
	handing
	orderedRetry
	heldMark
}

// deliveryState is where a delivery is in the owner's hands.
type deliveryState uint8

const (
	buffered  deliveryState = iota // claimed, waiting in the prefetch buffer
	handedOut                      // sent to the Router, waiting for Ack or Nack
	retrying                       // ordered mode: nacked, held, delivered again at retryAt
	writing                        // verdict recorded, its write pending or under way
	finished                       // written, lost or abandoned: no longer ours
)

// instant is a point on the monotonic clock: nanoseconds since the process
// started. A delivery keeps its times as instants rather than time.Time:
// smaller, and no pointer for the garbage collector to follow, in the
// struct the subscriber allocates for every row.
type instant int64

var processStart = time.Now()

func at(t time.Time) instant                    { return instant(t.Sub(processStart)) }
func (i instant) add(d time.Duration) instant   { return i + instant(d) }
func (i instant) since(j instant) time.Duration { return time.Duration(i - j) }

// time is i as a time.Time, its wall reading taken from the present: the
// wall clock may have been stepped since the process started (NTP, a
// virtual machine paused or restored), and an instant follows the
// monotonic clock, so processStart plus i would be off by every step.
func (i instant) time() time.Time {
	now := time.Now()
	return now.Add(time.Duration(i - at(now)))
}

// outcome carries what the handler's side knows to the subscriber: the
// error of a failure (Watermill's Nack carries none), and whether the
// handler's transaction deleted the row itself (tx.Middleware). It is the
// handoff.Row of the message's context.
type outcome struct {
	mu           sync.Mutex
	err          error
	rejectReason string
	// The context of a message a slot built: the owner ends it when the
	// row is lost while the handler runs (cancelMessage).
	cancelMsg context.CancelFunc
	cancelled bool

	// The row, for a deletion in the handler's transaction.
	complete string // query.CompleteInTx
	database string // the subscriber's current_database()
	id       int64
	token    pgtype.UUID
	inTx     atomic.Int32 // txNone, txCompleting, txCommitted
	// commitLost: the handler's transaction sent its COMMIT and lost the
	// answer; a row found gone afterwards was most likely completed by it.
	commitLost atomic.Bool
	// offerBy is the instant (see instant) after which a slot no longer
	// offers the message to the Router: the row's lease ends then, and the
	// row may be another consumer's (the process was frozen while the
	// message waited for a slot). Its lease's end, not a statement's time
	// before it as for the owner's own hand-out (admit): renewals run
	// about Lease/2 ahead of it, not StatementTimeout, and a message a
	// busy Router takes late must not be given back while its lease
	// holds. The owner moves it on at each renewal. 0: no limit.
	offerBy atomic.Int64
	// unhold asks the owner to make a held row a lease at once and waits
	// for it: the handler's transaction is about to start and to delete
	// the row, and its DELETE would wait for the held transaction's lock
	// until then. nil for a leased row. Once: unholding.
	unhold    func()
	unholding sync.Once

	facts facts // what DeliveryOf returns; set when created, never changed
}

const (
	txNone       = iota
	txCompleting // the handler returned; its transaction is finishing with the row
	txCommitted  // ... and committed: the row is gone, nothing more to write
)

// offerLeft is how long the message may still be offered to the Router.
func (o *outcome) offerLeft(now time.Time) time.Duration {
	by := o.offerBy.Load()
	if by == 0 {
		return math.MaxInt64
	}
	return instant(by).since(at(now))
}

// offerEnded reports whether the message may no longer be offered.
func (o *outcome) offerEnded(now time.Time) bool { return o.offerLeft(now) <= 0 }

func (sub *subscription) newOutcome(d *delivery) *outcome {
	o := &outcome{complete: sub.s.q.CompleteInTx, database: sub.s.facts.database, id: d.id, token: d.token, unhold: sub.unholder(d)}
	o.facts = newFacts(sub.outlet.origin, d)
	return o
}

var _ handoff.Row = (*outcome)(nil)

// Prepare implements handoff.Row.
func (o *outcome) Prepare() {
	if o.unhold != nil {
		o.unholding.Do(o.unhold)
	}
}

// Completion implements handoff.Row.
func (o *outcome) Completion() (string, []any) {
	o.Prepare()
	return o.complete, []any{o.id, o.token}
}

// Database implements handoff.Row.
func (o *outcome) Database() string { return o.database }

// Begin implements handoff.Row. A committed completion stays committed:
// a middleware that retries the handler after the commit must not undo it.
func (o *outcome) Begin() { o.inTx.CompareAndSwap(txNone, txCompleting) }

// End implements handoff.Row.
func (o *outcome) End(committed bool) {
	if committed {
		o.inTx.Store(txCommitted)
	} else {
		o.inTx.CompareAndSwap(txCompleting, txNone)
	}
}

// CommitUnanswered implements handoff.Row.
func (o *outcome) CommitUnanswered() { o.commitLost.Store(true) }

// Completed implements handoff.Row.
func (o *outcome) Completed() bool { return o.completedInTx() }

// completedInTx reports whether a handler's transaction deleted the row
// and committed.
func (o *outcome) completedInTx() bool { return o != nil && o.inTx.Load() == txCommitted }

// completingInTx reports whether a handler returned and its transaction
// is finishing with the row (publishing, deleting it, committing) or has
// committed: the row's absence is no lost lease, and the row is left to
// that transaction.
func (o *outcome) completingInTx() bool { return o != nil && o.inTx.Load() != txNone }

func outcomeFrom(ctx context.Context) *outcome {
	o, _ := handoff.From(ctx).(*outcome)
	return o
}

func (o *outcome) get() (rejectReason string, handlerErr error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.rejectReason, o.err
}

// setCancel records the cancel of the message's context (a slot built
// it), and calls it at once if the owner already asked.
func (o *outcome) setCancel(cancel context.CancelFunc) {
	o.mu.Lock()
	o.cancelMsg = cancel
	cancelled := o.cancelled
	o.mu.Unlock()
	if cancelled {
		cancel()
	}
}

// cancelMessage ends the context of the message a slot built, now or as
// soon as the slot built it.
func (o *outcome) cancelMessage() {
	o.mu.Lock()
	o.cancelled = true
	cancel := o.cancelMsg
	o.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

func (o *outcome) setErr(err error) {
	o.mu.Lock()
	o.err = err
	o.mu.Unlock()
}

// retryDelayKey stores, in the row's metadata, the delay a handler-side
// middleware (Watermill's DelayOnError) chose at the last nack. It is handed
// back to that middleware as "delayed for" on the next delivery, so its
// multiplier grows the delay.
const retryDelayKey = "_pgoutbox_retry_delayed_for"

// decodeMessage decodes a row. A row that does not decode is poisoned.
//
// Watermill's delay keys are instructions to a publisher, already applied
// (available_at): they are left out, so a handler or relay that copies the
// metadata into its output does not delay that output again. The exception
// keeps DelayOnError's growth: after a nack it delayed, the message carries
// "delayed for" (only that key; pgoutbox's publisher needs "delayed until"
// too before it delays anything, see schedule).
func decodeMessage(uuid string, payload, metaRaw []byte) (*message.Message, error) {
	msg := message.NewMessage(uuid, payload)
	if err := decodeMetadata(metaRaw, msg.Metadata); err != nil {
		return nil, err
	}
	delete(msg.Metadata, delay.DelayedUntilKey)
	delete(msg.Metadata, delay.DelayedForKey)
	if v, ok := msg.Metadata[retryDelayKey]; ok {
		delete(msg.Metadata, retryDelayKey)
		msg.Metadata[delay.DelayedForKey] = v
	}
	return msg, nil
}

// ErrRejected marks a failure as terminal: a handler error that wraps it
// (Reject's does) sends the message to the dead-letter table with reason
// "rejected", whatever the retry policy says, when the subscriber sees the
// handler's error (ErrorRecorder in the Router's middlewares). Without
// ErrorRecorder only a message marked by Reject or RejectContext is
// rejected. See Reject.
var ErrRejected = errors.New("pgoutbox: message rejected")

// Reject marks msg as never to be retried and returns an error (wrapping
// ErrRejected) for the handler to return:
//
//	return nil, pgoutbox.Reject(msg, "order id is missing")
//
// When the Router nacks the message, the subscriber moves it to the
// dead-letter table with reason "rejected" (or parks it, without one),
// whatever the retry policy says. The error is also permanent for
// Watermill's middleware.Retry, which returns it at once instead of
// retrying in memory.
//
// With ErrorRecorder in the middlewares, the error the handler returns
// decides: a handler that called Reject, handled its error and then failed
// with another is retried as that error says. Without ErrorRecorder the
// subscriber sees no error, and Reject's mark on the message decides.
func Reject(msg *message.Message, reason string) error {
	return RejectContext(msg.Context(), reason)
}

// RejectContext is Reject for code that has the message's context but not
// the message: a Watermill CQRS command or event handler, which gets the
// message's context (tx.Middleware's too):
//
//	return pgoutbox.RejectContext(ctx, "room does not exist")
//
// Given a context that no subscriber's message carries, it only returns
// the error: with ErrorRecorder the subscriber sees it wraps ErrRejected
// and rejects the message all the same (see Reject).
func RejectContext(ctx context.Context, reason string) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if o := outcomeFrom(ctx); o != nil {
		o.mu.Lock()
		o.rejectReason = reason
		o.mu.Unlock()
	}
	return backoff5.Permanent(fmt.Errorf("%w: %s", ErrRejected, reason))
}

// Redelivered reports whether err, returned by a handler of a subscriber's
// message, means that the subscriber took the message out of the
// handler's hands, and so delivers it again (or it was deleted meanwhile,
// by CancelScheduled or an Unbind with purge) whatever the middlewares do
// with the error: the message's context ended (context.Canceled: its
// AckDeadline passed, or a drain went past DrainTimeout; also a handler's
// own cancelled context), tx.Middleware found the message's lease lost
// (tx.ErrLeaseLost) and rolled the handler's transaction back, or its
// COMMIT got no answer (tx.ErrCommitUnanswered: done, or delivered
// again). A
// PoisonQueue filter leaves such an error alone; a poison copy of the
// message would be handled again beside its redelivery. It looks at the
// error only: a handler whose context ended returns msg.Context().Err(),
// or an error that wraps it, for the message to be recognised:
//
//	middleware.PoisonQueueWithFilter(pub, "poison", func(err error) bool {
//		return !errors.Is(err, pgoutbox.ErrRejected) && !pgoutbox.Redelivered(err)
//	})
func Redelivered(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, tx.ErrLeaseLost) || errors.Is(err, tx.ErrCommitUnanswered)
}

// ErrorRecorder is a Router middleware that hands the handler's error to the
// subscriber, which stores it in last_error (bounded to 8 KiB) and passes it
// to the RetryPolicy. Add it outside the middlewares that produce the final
// error (the first added is the outermost): outside Retry, so only the last
// attempt's error counts, and outside Recoverer, so a panic is recorded as
// the error it becomes:
//
//	router.AddMiddleware(pgoutbox.ErrorRecorder, middleware.Retry{...}.Middleware, middleware.Recoverer)
func ErrorRecorder(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		if err != nil {
			if o := outcomeFrom(msg.Context()); o != nil {
				o.setErr(err)
			}
		}
		return msgs, err
	}
}

// deliverySlab hands out a claim's deliveries from arrays of
// deliverySlabSize: one allocation for that many rows instead of one per
// row, in a drain the largest object allocated per message. An array
// stays alive until its last delivery is done, a few KB at most.
type deliverySlab struct{ free []delivery }

const deliverySlabSize = 32

func (s *deliverySlab) next() *delivery {
	if len(s.free) == 0 {
		s.free = make([]delivery, deliverySlabSize)
	}
	d := &s.free[0]
	s.free = s.free[1:]
	return d
}

// claimedRow is what a claim statement returned for a row; the claimer
// fills it in before the owner sees the delivery.
type claimedRow struct {
	id          int64
	token       pgtype.UUID // lease token of the claim that leased it
	deliveries  int         // including this one
	availableAt time.Time
	createdAt   int64 // when the row was published (its transaction's now()), unix microseconds
	uuid        string
	payload     []byte
	metaRaw     []byte // metadata as stored, to detect a handler's changes
	orderingKey string // "" for none; the end of a keyed row may unblock the next row of its key
	// arrival is where a held arrival is (Tables.Arrivals): Valid for a
	// row of the arrivals table, not the outbox. The held transaction's
	// lock keeps it there until the batch ends.
	arrival pgtype.TID
}
