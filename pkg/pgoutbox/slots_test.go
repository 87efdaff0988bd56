package pgoutbox

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// slotBundle runs slots that offer to out, with a Router stand-in that
// takes every message and counts them.
type slotBundle struct {
	slots    *slots
	inbox    *verdictInbox
	received atomic.Int32
	out      chan *message.Message
	taken    chan *message.Message
}

func newSlotBundle(t *testing.T, n int, ackDeadline time.Duration) *slotBundle {
	t.Helper()
	b := &slotBundle{inbox: newVerdictInbox(), out: make(chan *message.Message), taken: make(chan *message.Message, 1000)}
	b.slots = newSlots(n, 1000, b.inbox, slotEnv{out: b.out, parent: context.Background(), ackDeadline: ackDeadline, handedOut: func(*outcome) {}})
	stopReader := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			select {
			case m := <-b.out:
				b.received.Add(1)
				b.taken <- m
			case <-stopReader:
				return
			}
		}
	}()
	b.slots.start()
	t.Cleanup(func() {
		b.slots.stop()
		close(stopReader)
		<-readerDone
	})
	return b
}

func item(id int64, abandon <-chan struct{}) slotItem {
	return slotItem{d: &delivery{claimedRow: claimedRow{id: id}}, uuid: "u", payload: []byte("p"), metaRaw: []byte("{}"), outcome: &outcome{}, abandon: abandon}
}

// waitVerdicts takes verdicts until n arrived.
func (b *slotBundle) waitVerdicts(t *testing.T, n int) []verdict {
	t.Helper()
	var got []verdict
	deadline := time.After(10 * time.Second)
	for len(got) < n {
		select {
		case <-b.inbox.wake:
			v, _ := b.inbox.take(nil)
			got = append(got, v...)
		case <-deadline:
			t.Fatalf("%d of %d verdicts", len(got), n)
		}
	}
	return got
}

// An item the owner abandoned before a slot offered it never reaches the
// Router, though the Router is ready to take it: a select with both
// cases ready would pick either.
func TestSlotNeverOffersAnAbandonedMessage(t *testing.T) {
	t.Parallel()
	b := newSlotBundle(t, 4, 0)
	abandoned := make(chan struct{})
	close(abandoned)
	for i := range int64(200) {
		b.slots.hand(item(i, abandoned))
	}
	live := make(chan struct{})
	b.slots.hand(item(999, live)) // behind them: once it arrives, every slot went past the abandoned ones
	m := <-b.taken
	require.Equal(t, int32(1), b.received.Load(), "no abandoned message reached the Router")
	m.Ack()
	v := b.waitVerdicts(t, 1)
	require.Equal(t, int64(999), v[0].d.id)
	require.True(t, v[0].ack)
}

// After the subscription stops, queued items are reported unsent and never
// offered.
func TestSlotReportsItemsUnsentAfterTheStop(t *testing.T) {
	t.Parallel()
	b := newSlotBundle(t, 2, 0)
	b.slots.stopOffering()
	for i := range int64(50) {
		b.slots.hand(item(i, make(chan struct{})))
	}
	for _, v := range b.waitVerdicts(t, 50) {
		require.True(t, v.unsent)
	}
	require.Zero(t, b.received.Load())
}

// The ack deadline applies to every message of a slot, also after a
// deadline found an earlier message's transaction completing.
func TestSlotAckDeadlineSurvivesACompletingTransaction(t *testing.T) {
	t.Parallel()
	b := newSlotBundle(t, 1, 30*time.Millisecond)
	first := item(1, make(chan struct{}))
	first.outcome.Begin() // its handler's transaction deletes the row
	b.slots.hand(first)
	m1 := <-b.taken
	time.Sleep(60 * time.Millisecond) // past the deadline: it waits for the transaction
	first.outcome.End(true)
	m1.Ack()
	v := b.waitVerdicts(t, 1)
	require.True(t, v[0].ack)
	require.False(t, v[0].timedOut)

	b.slots.hand(item(2, make(chan struct{}))) // a handler that never answers
	<-b.taken
	v = b.waitVerdicts(t, 1)
	require.Equal(t, int64(2), v[0].d.id)
	require.True(t, v[0].timedOut, "the deadline still applies to the slot's next message")

	// A transaction that rolls back after the deadline found it completing
	// does not exempt its message for good either.
	third := item(3, make(chan struct{}))
	third.outcome.Begin()
	b.slots.hand(third)
	<-b.taken
	time.Sleep(60 * time.Millisecond)
	third.outcome.End(false)
	v = b.waitVerdicts(t, 1)
	require.True(t, v[0].timedOut)
}

// A message whose offer ended while it waited for a slot (the process was
// frozen past the row's lease) goes back unsent, though the Router is ready
// to take it: another consumer may have the row, and its key's next ones.
func TestSlotDoesNotOfferAMessageWhoseLeaseMayHavePassed(t *testing.T) {
	t.Parallel()
	b := newSlotBundle(t, 1, 0)
	stale := item(1, make(chan struct{}))
	stale.outcome.offerBy.Store(int64(at(time.Now()).add(-time.Millisecond)))
	b.slots.hand(stale)
	fresh := item(2, make(chan struct{}))
	fresh.outcome.offerBy.Store(int64(at(time.Now()).add(time.Hour)))
	b.slots.hand(fresh)
	m := <-b.taken
	m.Ack()
	v := b.waitVerdicts(t, 2)
	require.Equal(t, int64(1), v[0].d.id)
	require.True(t, v[0].unsent, "the stale one comes back unsent")
	require.Equal(t, int64(2), v[1].d.id)
	require.True(t, v[1].ack)
	require.Equal(t, int32(1), b.received.Load(), "only the fresh one reached the Router")
}

// An offer the Router does not take ends when the offer does, unless a
// renewal moved it on meanwhile.
func TestSlotOfferEndsWithItsLeaseUnlessRenewed(t *testing.T) {
	t.Parallel()
	inbox := newVerdictInbox()
	out := make(chan *message.Message) // a Router busy with other messages
	s := newSlots(2, 10, inbox, slotEnv{out: out, parent: context.Background(), handedOut: func(*outcome) {}})
	s.start()
	t.Cleanup(s.stop)
	ending, renewed := item(1, make(chan struct{})), item(2, make(chan struct{}))
	ending.outcome.offerBy.Store(int64(at(time.Now()).add(50 * time.Millisecond)))
	renewed.outcome.offerBy.Store(int64(at(time.Now()).add(50 * time.Millisecond)))
	s.hand(ending)
	s.hand(renewed)
	renewed.outcome.offerBy.Store(int64(at(time.Now()).add(time.Hour))) // the owner renewed its lease
	var v []verdict
	select {
	case <-inbox.wake:
		v, _ = inbox.take(nil)
	case <-time.After(10 * time.Second):
		t.Fatal("the offer did not end")
	}
	require.Len(t, v, 1)
	require.Equal(t, int64(1), v[0].d.id)
	require.True(t, v[0].unsent)
	m := <-out // the Router takes the renewed one at last
	m.Ack()
	select {
	case <-inbox.wake:
		v, _ = inbox.take(nil)
	case <-time.After(10 * time.Second):
		t.Fatal("no verdict for the renewed one")
	}
	require.Equal(t, int64(2), v[0].d.id)
	require.True(t, v[0].ack)
}

// The inbox keeps its array for the next verdicts; the verdicts taken must
// not stay in it, or an idle subscription keeps their messages alive
// (tens of megabytes with large payloads).
func TestVerdictInboxLetsGoOfWhatWasTaken(t *testing.T) {
	t.Parallel()
	in := newVerdictInbox()
	for range 4 {
		in.put(verdict{msg: message.NewMessage("u", make([]byte, 1<<20))})
	}
	buf, _ := in.take(nil)
	require.Len(t, buf, 4)
	for _, v := range in.list[:cap(in.list)] {
		require.True(t, v.msg == nil, "a taken verdict left in the inbox's array") // (not Nil: it would print the payload)
	}
}
