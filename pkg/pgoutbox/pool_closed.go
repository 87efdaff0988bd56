package pgoutbox

import (
	"errors"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/puddle/v2"
)

// isPoolClosed reports whether err says the pgxpool.Pool was closed: final,
// unlike every other database error, so retrying it only fills the log.
func isPoolClosed(err error) bool { return err != nil && errors.Is(err, puddle.ErrClosedPool) }

// poolClosedBy reports whether r is the first report of this subscription
// to say its pool was closed. The subscription then ends (the owner stops
// it, and finishedStopping gives up on the writes left): one ERROR says
// why, and the errors of the writes that follow are logged at DEBUG.
// Nothing is deleted: rows still leased come back when their leases
// expire.
func (sub *subscription) poolClosedBy(r report) bool {
	if sub.drain.poolClosed {
		return false
	}
	var err error
	switch {
	case r.claim != nil:
		err = r.claim.err
	case r.write != nil:
		err = errors.Join(r.write.err, r.write.releaseErr)
	case r.batch != nil:
		err = r.batch.err
	}
	if !isPoolClosed(err) {
		return false
	}
	sub.drain.poolClosed = true
	sub.logger.Error("Subscription ends: its pool was closed; close the Subscriber (or end the Subscribe context) before closing its pool", err, nil)
	sub.logger = errorsAsDebug{sub.logger}
	return true
}

// errorsAsDebug logs ERROR lines at DEBUG.
type errorsAsDebug struct{ watermill.LoggerAdapter }

func (l errorsAsDebug) Error(msg string, err error, fields watermill.LogFields) {
	l.Debug(msg, fields.Add(watermill.LogFields{"err": err}))
}

func (l errorsAsDebug) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return errorsAsDebug{l.LoggerAdapter.With(fields)}
}
