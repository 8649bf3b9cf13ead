package console

// Names the external tests use.
const CookieName = cookieName

type JobStatus = replayJob
