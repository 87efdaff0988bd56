package pgoutbox

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

type recordingObserver struct {
	mu     sync.Mutex
	events []EventKind
}

func (r *recordingObserver) Observe(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e.Kind)
}

// An event queue runs its goroutine from its first event: a Subscriber
// that never subscribed (cqrsbind's, built to read a group) holds none and
// need not be closed. Events queued before close are delivered; later
// ones are not.
func TestEventQueueStartsWithItsFirstEvent(t *testing.T) {
	t.Parallel()
	idle := newEventQueue(safeObserver{o: &recordingObserver{}, logger: watermill.NopLogger{}})
	require.False(t, idle.started)
	idle.close(time.Minute) // returns without a goroutine to wait for

	rec := &recordingObserver{}
	q := newEventQueue(safeObserver{o: rec, logger: watermill.NopLogger{}})
	q.setIdle(false) // a subscription runs: the goroutine stays
	q.observe(Event{Kind: EventClaimed})
	q.observe(Event{Kind: EventAcked})
	q.mu.Lock()
	require.True(t, q.started)
	q.mu.Unlock()
	q.close(time.Minute)
	q.observe(Event{Kind: EventReleased})
	require.Equal(t, []EventKind{EventClaimed, EventAcked}, rec.events)
}

// The queue's goroutine ends once the Subscriber has no subscription and
// the queue is empty, and the next event starts another: a Subscriber
// left unclosed (a Router stopped by its context) keeps none.
func TestEventQueueEndsItsGoroutineWhenIdle(t *testing.T) {
	t.Parallel()
	rec := &recordingObserver{}
	q := newEventQueue(safeObserver{o: rec, logger: watermill.NopLogger{}})
	running := func() chan struct{} {
		q.mu.Lock()
		defer q.mu.Unlock()
		require.True(t, q.started)
		return q.done
	}
	ended := func(done chan struct{}) {
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the goroutine of an idle queue did not end")
		}
	}
	q.setIdle(false)
	q.observe(Event{Kind: EventClaimed})
	first := running()
	q.setIdle(true)
	ended(first)

	q.observe(Event{Kind: EventAcked}) // a late event of the ended subscription
	// Its goroutine observes it and ends, maybe before the test looks.
	deadline := time.Now().Add(10 * time.Second)
	for {
		q.mu.Lock()
		started := q.started
		q.mu.Unlock()
		rec.mu.Lock()
		seen := len(rec.events)
		rec.mu.Unlock()
		if seen == 2 && !started {
			break
		}
		require.True(t, time.Now().Before(deadline), "the late event observed and its goroutine ended")
		time.Sleep(time.Millisecond)
	}

	q.setIdle(false)
	q.observe(Event{Kind: EventReleased})
	again := running()
	select {
	case <-again:
		t.Fatal("ended while a subscription runs")
	case <-time.After(50 * time.Millisecond):
	}
	q.close(time.Minute)
	ended(again)
	require.Equal(t, []EventKind{EventClaimed, EventAcked, EventReleased}, rec.events)
}

// blockingObserver blocks in its first Observe, after closing entered,
// until release is closed.
type blockingObserver struct {
	recordingObserver
	entered, release chan struct{}
	once             sync.Once
}

func (b *blockingObserver) Observe(e Event) {
	b.once.Do(func() {
		close(b.entered)
		<-b.release
	})
	b.recordingObserver.Observe(e)
}

// Close does not wait for a slow Observer to work through its queue: close
// returns once its bound has passed, and the events not observed by then
// are dropped, with a log line that counts them.
func TestEventQueueCloseIsBounded(t *testing.T) {
	t.Parallel()
	obs := &blockingObserver{entered: make(chan struct{}), release: make(chan struct{})}
	logs := watermill.NewCaptureLogger()
	q := newEventQueue(safeObserver{o: obs, logger: logs})
	for range 10 {
		q.observe(Event{Kind: EventAcked})
	}
	<-obs.entered                  // the first event is being observed; nine wait
	q.close(10 * time.Millisecond) // the Observer is stuck in its first event: returns all the same
	close(obs.release)
	<-q.done
	obs.mu.Lock()
	defer obs.mu.Unlock()
	require.Less(t, len(obs.events), 10, "the queue was not worked through after close gave up")
	require.True(t, logs.Has(watermill.CapturedMessage{Level: watermill.ErrorLogLevel,
		Msg: "Observer too slow at Close; the events it had not taken are dropped", Fields: watermill.LogFields{"dropped": 9}}))
}
