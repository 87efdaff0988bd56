package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgtype"
)

// delivery is one claimed row, from claim to its completion write.
type delivery struct {
	id          int64
	token       pgtype.UUID // lease token of the claim that leased it
	deliveries  int         // including this one
	availableAt time.Time
	uuid        string
	payload     []byte
	metaRaw     []byte // metadata as stored, to detect a handler's changes
	claimedAt   time.Time

	outcome *outcome     // reachable from the message context
	lost    atomic.Bool  // a write found the lease taken by someone else
	state   atomic.Int32 // buffered, handedOut or givenBack
	expires atomic.Int64 // when our lease ends, at the latest: nanoseconds on the monotonic clock (sinceStart)
}

// Delivery states: a claimed row waits in the prefetch buffer until a
// worker hands it out, unless the completer gives it back first (renew).
const (
	buffered int32 = iota
	handedOut
	givenBack
)

// handOut marks d as handed to the Router; false if it was given back.
func (d *delivery) handOut() bool { return d.state.CompareAndSwap(buffered, handedOut) }

// giveBack marks a buffered d as given back; false if it was handed out.
func (d *delivery) giveBack() bool { return d.state.CompareAndSwap(buffered, givenBack) }

// processStart anchors delivery expiry times to the monotonic clock.
var processStart = time.Now()

func sinceStart(t time.Time) int64 { return int64(t.Sub(processStart)) }

// leasedUntil records when the lease ends by the latest write that set it,
// measured from the moment that write was sent: earlier than the database's
// own expiry, never later.
func (d *delivery) leasedUntil(t time.Time) { d.expires.Store(sinceStart(t)) }

// leaseLikelyGone reports whether handing d out would risk a second holder:
// its lease was found lost, or is about to expire without a renewal having
// reached the database (the buffer waited longer than a renewal period).
func (d *delivery) leaseLikelyGone(margin time.Duration) bool {
	return d.lost.Load() || sinceStart(time.Now().Add(margin)) >= d.expires.Load()
}

// outcome carries what the handler's side knows about a failure to the
// subscriber: Watermill's Nack carries no error.
type outcome struct {
	mu           sync.Mutex
	err          error
	rejectReason string
}

type outcomeKey struct{}

func outcomeFrom(ctx context.Context) *outcome {
	o, _ := ctx.Value(outcomeKey{}).(*outcome)
	return o
}

func (o *outcome) get() (rejectReason string, handlerErr error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.rejectReason, o.err
}

// message decodes the row. A row that does not decode is poisoned.
//
// Watermill's "delayed until" key is left out: it was an instruction to
// the publisher, already applied (available_at), and its absence lets the
// subscriber see when a failing handler's DelayOnError set a new one, even
// when the delay itself no longer grows (see nacked).
func (d *delivery) message() (*message.Message, error) {
	msg := message.NewMessage(d.uuid, d.payload)
	if err := decodeMetadata(d.metaRaw, msg.Metadata); err != nil {
		return nil, err
	}
	delete(msg.Metadata, delay.DelayedUntilKey)
	return msg, nil
}

// ErrRejected marks a failure as terminal; see Reject.
var ErrRejected = errors.New("pgoutbox: message rejected")

// Reject marks msg as never to be retried and returns an error (wrapping
// ErrRejected) for the handler to return:
//
//	return nil, pgoutbox.Reject(msg, "order id is missing")
//
// When the Router nacks the message, the subscriber moves it to the
// dead-letter table with reason "rejected" (or deletes it, without one),
// whatever the retry policy says.
func Reject(msg *message.Message, reason string) error {
	if o := outcomeFrom(msg.Context()); o != nil {
		o.mu.Lock()
		o.rejectReason = reason
		o.mu.Unlock()
	}
	return fmt.Errorf("%w: %s", ErrRejected, reason)
}

// ErrorRecorder is a Router middleware that hands the handler's error to the
// subscriber, which stores it in last_error (bounded to 8 KiB) and passes it
// to the RetryPolicy. Add it innermost of the middlewares that turn an error
// into a Nack (after Retry, so only the final error counts):
//
//	router.AddMiddleware(middleware.Retry{...}.Middleware, pgoutbox.ErrorRecorder)
func ErrorRecorder(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		if err != nil {
			if o := outcomeFrom(msg.Context()); o != nil {
				o.mu.Lock()
				o.err = err
				o.mu.Unlock()
			}
		}
		return msgs, err
	}
}
