package amqp

// ArgMessageTTL is argMessageTTL, for the external tests.
const ArgMessageTTL = argMessageTTL
