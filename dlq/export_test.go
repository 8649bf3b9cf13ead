package dlq

// GateWindow is gateWindow, for the external tests.
const GateWindow = gateWindow
